"""The engine heartbeat banner: telemetry failure and stale heartbeat, on every page; crashed runs in the picker."""
import json
import subprocess
import sys
import time

import pytest

from dashboard.panels.status_banner import banner_for
from telemetry.procs import is_engine_pid as is_pid_alive

PAGES = [None, "chunks", "requests", "levers", "runs"]
SERVING = {"state": "serving", "pid": 4242, "tick": 77, "telemetry_error": None, "num_dropped": 0,
           "updated_at": 0.0, "is_stale": False}


def test_banner_decisions():
    assert banner_for(None, True) is None
    assert banner_for(SERVING, True) is None
    failing = {**SERVING, "telemetry_error": "OSError: [Errno 28] No space left on device", "num_dropped": 1234}
    banner = banner_for(failing, True)
    assert banner.level == "error"
    assert "Telemetry store failing: OSError: [Errno 28] No space left on device" in banner.message
    assert "1,234 events dropped" in banner.message and "keeps serving" in banner.message
    ended = banner_for({**failing, "state": "finished"}, False)
    assert ended.level == "warning" and "incomplete" in ended.message
    stale = banner_for({**SERVING, "is_stale": True, "updated_at": time.time() - 30}, True)
    assert stale.level == "warning" and "heartbeat" in stale.message and "tick 77" in stale.message
    # a dead engine is not "stuck": it crashed (its heartbeat still says serving)
    crashed = banner_for({**SERVING, "is_stale": True, "run_id": 3}, False)
    assert crashed.level == "error" and crashed.message.startswith("Engine crashed: run 3 (pid 4242) died at tick 77")
    assert banner_for({**SERVING, "state": "finished"}, False) is None


def test_pid_alive_checks():
    assert not is_pid_alive(None) and not is_pid_alive(True) and not is_pid_alive(-3)
    assert not is_pid_alive(2 ** 22 + 12345)


@pytest.fixture(scope="module")
def engine_like_process():
    """A live process whose command line names the engine, like ``python -m engine serve``."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "engine", "serve"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _write_status(run_dir, **fields):
    status = {**SERVING, "updated_at": time.time(), **fields}
    status.pop("is_stale")
    (run_dir / "engine_status.json").write_text(json.dumps(status))


@pytest.mark.parametrize("page", PAGES)
def test_failure_banner_on_every_page(app, run_fixture, tmp_path, engine_like_process, page):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "telemetry.db").write_bytes(run_fixture.db.read_bytes())
    _write_status(run_dir, pid=engine_like_process, telemetry_error="database is locked", num_dropped=5000)
    at = app(page, run_dir=run_dir)
    assert any("Telemetry store failing: database is locked; 5,000 events dropped" in e.value for e in at.error)


def test_stale_heartbeat_warning_and_none_when_fresh(app, tmp_path, engine_like_process):
    _write_status(tmp_path, pid=engine_like_process, updated_at=time.time() - 60)
    at = app(None, run_dir=tmp_path, run_id=None)
    assert any("has not moved for" in w.value for w in at.warning)
    _write_status(tmp_path, pid=engine_like_process)
    at = app(None, run_dir=tmp_path, run_id=None)
    assert not at.error and not any("heartbeat" in w.value for w in at.warning)


def test_garbage_status_file_is_ignored(app, tmp_path):
    (tmp_path / "engine_status.json").write_text("{half")
    at = app(None, run_dir=tmp_path, run_id=None)
    assert not at.exception and not at.error


def test_run_picker_labels_crashed_runs(app):
    at = app("runs", run_id=None)
    options = at.sidebar.selectbox[0].options
    assert "latest run" in options and "run 2 · tiny" in options
    assert "run 2: crashed" in [c.value for c in at.sidebar.caption]
