"""The lever watcher with its real watchdog observer: one look per file change, one rejection per version."""
from __future__ import annotations

import time

import pytest

from engine.serve.lever_watch import LeverWatcher
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
    sched = Scheduler(ModelRunner.build(no_mtp_model, num_kv_blocks=32, num_ssm_slots=2), defaults(), emit=rows.append)
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
    sched = Scheduler(ModelRunner.build(tiny, num_kv_blocks=32, num_ssm_slots=2), defaults(), emit=rows.append)
    watcher = LeverWatcher(path, defaults())
    try:
        path.write_text('{"version": 3, "levers": {"max_prefill_tokens": -5}}')
        poll_into(sched, watcher, 60)
        assert len(rejections(rows)) == 1 and "max_prefill_tokens" in rejections(rows)[0].reason
    finally:
        watcher.stop()


def test_the_telemetry_store_traffic_beside_the_file_never_reaches_the_observer(tmp_path):
    """The run directory also holds the WAL store: the engine writes its -wal ~20 times a second and
    an open dashboard opens and closes it ~15 times a second. None of that may be delivered to the
    observer (each event cost its threads CPU while the engine was blocked), yet an atomic replace
    of the levers file still wakes a waiting loop at once, and an in-place edit is still seen."""
    import sqlite3

    path = tmp_path / "levers.json"
    write_levers_file(path, 1, defaults())
    watcher = LeverWatcher(path, defaults())
    try:
        assert watcher.poll(defaults()) is None          # the first read: defaults, nothing to change
        store = sqlite3.connect(tmp_path / "telemetry.db")
        store.execute("PRAGMA journal_mode=WAL")
        store.execute("CREATE TABLE ticks (tick INTEGER)")
        (tmp_path / "engine.log").touch()
        time.sleep(0.3)
        assert watcher.handler is not None
        at_start = watcher.handler.num_events            # the files' creation: once per run
        for tick in range(40):                           # the writer's commits
            store.execute("INSERT INTO ticks VALUES (?)", [tick])
            store.commit()
            reader = sqlite3.connect(f"file:{tmp_path / 'telemetry.db'}?mode=ro", uri=True)
            reader.execute("SELECT COUNT(*) FROM ticks").fetchone()   # the dashboard's reads
            reader.close()
            with open(tmp_path / "engine.log", "a") as log_file:      # log lines
                log_file.write(f"tick {tick}\n")
        time.sleep(0.3)
        assert watcher.handler.num_events == at_start, \
            f"{watcher.handler.num_events - at_start} events from the store's traffic reached the observer"
        store.close()
        watcher.poll(defaults())                         # the creations above flagged the directory

        write_levers_file(path, 2, defaults().replace(max_prefill_tokens=64))   # tmp + os.replace
        assert watcher.wait_for_change(5.0), "an atomic replace of the levers file did not wake the loop"
        update = watcher.poll(defaults())
        assert update is not None and update.values.max_prefill_tokens == 64

        time.sleep(0.05)      # a later mtime than the replace's
        path.write_text('{"version": 3, "levers": {"max_prefill_tokens": 32}}')   # an editor, in place
        current, deadline = update.values, time.monotonic() + 5.0
        while (update := watcher.poll(current)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert update is not None and update.values.max_prefill_tokens == 32
    finally:
        watcher.stop()
