"""The engine heartbeat file: atomic JSON, stale detection, never raises on an unwritable run dir."""
from __future__ import annotations

import json
import logging
import os

from telemetry.engine_status import STALE_AFTER_S, StatusReporter, read_engine_status, status_path


def test_reporter_writes_atomically_at_most_once_per_interval(tmp_path):
    reporter = StatusReporter(tmp_path, interval_s=60)
    assert reporter.maybe_write({"tick": 1, "telemetry": "ok"}) is True
    assert reporter.maybe_write({"tick": 2, "telemetry": "ok"}) is False      # within the interval
    assert reporter.maybe_write({"tick": 3, "telemetry": "failing"}, force=True) is True
    status = read_engine_status(tmp_path)
    assert status["tick"] == 3 and status["telemetry"] == "failing" and status["pid"] == os.getpid()
    assert status["is_stale"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["engine_status.json"], "no temp files left behind"


def test_stale_missing_and_garbage_status(tmp_path):
    assert read_engine_status(tmp_path) is None
    StatusReporter(tmp_path).maybe_write({"tick": 5})
    updated_at = json.loads(status_path(tmp_path).read_text())["updated_at"]
    assert read_engine_status(tmp_path, now=updated_at + STALE_AFTER_S + 1)["is_stale"] is True
    status_path(tmp_path).write_bytes(b"{half")
    assert read_engine_status(tmp_path) is None
    status_path(tmp_path).write_text(json.dumps([1, 2]))
    assert read_engine_status(tmp_path) is None


def test_unwritable_run_dir_is_logged_once_and_never_raises(tmp_path, caplog):
    missing = tmp_path / "gone"           # a run dir that vanished: every write fails
    reporter = StatusReporter(missing, interval_s=0)
    with caplog.at_level(logging.ERROR, logger="chunkscope.status"):
        for tick in range(5):
            assert reporter.maybe_write({"tick": tick}) is True
    assert reporter.num_writes == 0
    assert len([r for r in caplog.records if "cannot write the engine status file" in r.message]) == 1
    missing.mkdir()
    assert reporter.maybe_write({"tick": 9}) and read_engine_status(missing)["tick"] == 9
