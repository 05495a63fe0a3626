"""Serve-side helpers in one process: the run-dir lock (held, refused, released, stale), the checkpoint hash
(what changes it and what does not), the device line, the log-file check and the stall watch's reports."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.serve.engine_setup import checkpoint_hash, device_description
from engine.serve.process import _is_same_file
from engine.serve.run_dir_lock import LOCK_NAME, RunDirBusy, lock_run_dir
from engine.serve.stall_watch import StallWatch
from telemetry import events as ev


def test_the_lock_names_its_holder_and_frees_with_the_file(tmp_path):
    first = lock_run_dir(tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunDirBusy) as busy:
            lock_run_dir(tmp_path)     # another open file description: flock refuses it as it would a process
        assert str(busy.value) == (f"--run-dir {tmp_path}: another engine (pid {os.getpid()}) is serving this "
                                   "directory; stop it first or pick another directory")
    finally:
        first.close()
    again = lock_run_dir(tmp_path)
    assert again is not None
    again.close()


def test_a_stale_lock_file_never_blocks_and_is_rewritten(tmp_path):
    (tmp_path / LOCK_NAME).write_text("999999\nleft by a killed engine\n")
    handle = lock_run_dir(tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        handle.close()


def test_a_directory_that_cannot_hold_a_lock_serves_without_one(tmp_path):
    assert lock_run_dir(tmp_path / "missing" / "deeper") is None


def checkpoint(directory: Path) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    (directory / "model.safetensors").write_bytes(b"\x00" * 64)
    return directory


def test_the_checkpoint_hash_follows_config_and_weights_only(tmp_path):
    one, two = checkpoint(tmp_path / "one"), checkpoint(tmp_path / "two")
    digest = checkpoint_hash(one)
    assert len(digest) == 64 and digest == checkpoint_hash(two), "same files, same hash wherever they live"
    (two / "README.md").write_text("notes")
    assert checkpoint_hash(two) == digest, "files that are not config or weights do not count"
    (two / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    assert checkpoint_hash(two) != digest, "one weight byte"
    (two / "model.safetensors").write_bytes(b"\x00" * 64)
    (two / "model.safetensors").rename(two / "model-00001.safetensors")
    assert checkpoint_hash(two) != digest, "a renamed shard"
    (two / "model-00001.safetensors").rename(two / "model.safetensors")
    (two / "tokenizer.json").write_text("{}")
    assert checkpoint_hash(two) != digest, "the tokenizer is part of what a run used"


def test_the_cpu_device_line_names_the_processor_and_threads():
    line = device_description("cpu")
    assert line.startswith("cpu (") and line.endswith(" threads)") and "," in line


def test_the_log_file_check_compares_the_open_file(tmp_path):
    log = tmp_path / "engine.log"
    with open(log, "w") as stream:
        assert _is_same_file(stream, log)
        assert not _is_same_file(stream, tmp_path / "other.log")
        assert not _is_same_file(SimpleNamespace(), log), "a stream without a file (pytest's capture)"
    assert not _is_same_file(stream, log), "a closed stream"


class FakeScheduler:
    """What the stall watch reads: the queue, the tick and where events go."""

    def __init__(self) -> None:
        self.waiting = [SimpleNamespace(request_id=4)]
        self.prefilling = SimpleNamespace(request_id=3)   # a prefill in flight: the head is not blocked
        self.has_work = True
        self.tick = 10
        self.events: list = []
        self.emit = self.events.append

    @staticmethod
    def now_ns() -> int:
        return 123


def test_the_stall_watch_reports_each_change_once():
    sched, watch = FakeScheduler(), StallWatch()
    assert watch.after_step(sched, progressed=True) is False and sched.events == []
    assert watch.after_step(sched, progressed=False) is True
    assert watch.after_step(sched, progressed=False) is True
    assert watch.num_stalls == 1 and len(sched.events) == 1, "one report per blocker, not per tick"
    stalled = sched.events[0]
    assert isinstance(stalled, ev.GenericEvent) and stalled.kind == "stalled" and stalled.request_id == 4
    assert stalled.detail == {"blocker": "no request can start", "num_waiting": 1}
    sched.tick = 12
    assert watch.after_step(sched, progressed=True) is False
    cleared = sched.events[1]
    assert (cleared.kind, cleared.tick, cleared.detail) == ("stall_cleared", 12, {"blocker": "no request can start"})
    assert watch.blocker is None
    sched.has_work = False
    assert watch.after_step(sched, progressed=False) is False, "idle is not a stall"
    assert len(sched.events) == 2
