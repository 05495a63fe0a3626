"""The lever watcher with its real watchdog observer: one look per file change, one rejection per version."""
from __future__ import annotations

import time

import pytest

from engine.lever_watch import LeverWatcher
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults, write_levers_file


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    return model


def poll_into(sched: Scheduler, watcher: LeverWatcher, polls: int) -> None:
    """What serve's loop does between ticks, ``polls`` times, with a short pause for inotify events."""
    for _ in range(polls):
        update = watcher.poll(sched.levers)
        if update is not None:
            if update.error is not None:
                sched.reject_levers(update.error, source="file")
            else:
                sched.apply_levers(update.values, source="file", version=update.version)
        time.sleep(0.01)


def rejections(rows: list) -> list:
    return [r for r in rows if isinstance(r, ev.LeverChange) and r.status == "rejected"]


def test_reading_the_file_does_not_count_as_a_change(tmp_path):
    """Opening the file raises inotify open/close events; they must not make the watcher read again."""
    path = tmp_path / "levers.json"
    write_levers_file(path, 1, defaults().replace(max_prefill_tokens=64))
    watcher = LeverWatcher(path, defaults())
    try:
        first = watcher.poll(defaults())
        assert first is not None and first.values.max_prefill_tokens == 64
        for _ in range(20):
            time.sleep(0.02)
            assert watcher.poll(first.values) is None
        assert watcher.num_reads == 1, f"the watcher re-read an unchanged file {watcher.num_reads - 1} times"
    finally:
        watcher.stop()


@pytest.fixture(scope="module")
def no_mtp_model(hf_checkpoint):
    """A checkpoint without mtp.* tensors (transformers writes none): it refuses speculation=mtp."""
    model, _, _ = load_model(hf_checkpoint("base")[1])
    assert not model.has_mtp_head
    return model


def test_a_lever_the_engine_refuses_is_rejected_once_per_file_version(no_mtp_model, tmp_path):
    path = tmp_path / "levers.json"
    rows: list = []
    sched = Scheduler(ModelRunner(no_mtp_model, num_kv_blocks=32, num_ssm_slots=2), defaults(), emit=rows.append)
    watcher = LeverWatcher(path, defaults())
    try:
        write_levers_file(path, 1, defaults().replace(speculation="mtp"))
        poll_into(sched, watcher, 60)
        assert [(r.name, r.file_version) for r in rejections(rows)] == [("speculation", 1)]
        assert sched.levers.speculation == "off"
        # A new version that still asks for mtp (and changes something else) is one more rejection,
        # and its other change applies.
        write_levers_file(path, 2, defaults().replace(speculation="mtp", max_prefill_tokens=64))
        poll_into(sched, watcher, 60)
        assert [(r.name, r.file_version) for r in rejections(rows)] == [("speculation", 1), ("speculation", 2)]
        assert sched.levers.max_prefill_tokens == 64
        applied = [r for r in rows if isinstance(r, ev.LeverChange) and r.status == "applied"]
        assert [(r.name, r.file_version) for r in applied] == [("max_prefill_tokens", 2)]
    finally:
        watcher.stop()


def test_a_file_that_fails_validation_is_rejected_once_until_it_changes(tiny, tmp_path):
    path = tmp_path / "levers.json"
    rows: list = []
    sched = Scheduler(ModelRunner(tiny, num_kv_blocks=32, num_ssm_slots=2), defaults(), emit=rows.append)
    watcher = LeverWatcher(path, defaults())
    try:
        path.write_text('{"version": 3, "levers": {"max_prefill_tokens": -5}}')
        poll_into(sched, watcher, 60)
        assert len(rejections(rows)) == 1 and "max_prefill_tokens" in rejections(rows)[0].reason
    finally:
        watcher.stop()
