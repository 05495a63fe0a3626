"""Run-dir resolution, the inside-the-run-dir guard, and background engine start / stop."""
import json
import os
import sys
import time

import pytest

from dashboard import engine_control as ec
from dashboard.paths import ENV_RUN_DIR, PathOutsideRunDir, RunPaths, inside_run_dir, run_dir_from


def test_run_dir_precedence(tmp_path):
    assert run_dir_from(["--run-dir", str(tmp_path / "a")], {ENV_RUN_DIR: str(tmp_path / "b")}) == tmp_path / "a"
    assert run_dir_from([], {ENV_RUN_DIR: str(tmp_path / "b")}) == tmp_path / "b"
    assert run_dir_from([], {}).parts[-2:] == ("runs", "default")


@pytest.mark.parametrize("typed", ["/etc/passwd", "../outside", "sub/../../x", "", "a\x00b"])
def test_inside_run_dir_rejects_escapes(tmp_path, typed):
    with pytest.raises(PathOutsideRunDir):
        inside_run_dir(tmp_path / "run", typed)


def test_inside_run_dir_rejects_symlink_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "link").symlink_to(tmp_path)
    with pytest.raises(PathOutsideRunDir, match="outside the run directory"):
        inside_run_dir(run, "link/x")
    assert inside_run_dir(run, "models/ckpt") == (run / "models" / "ckpt").resolve()


def test_engine_argv_validates_fields(tmp_path):
    paths = RunPaths(tmp_path)
    argv = ec.engine_argv(paths, "tiny", "synthetic", 4)
    assert argv[1:] == ["-m", "engine", "serve", "--model", "tiny", "--run-dir", str(tmp_path),
                        "--workload", "synthetic", "--rate", "4"]
    with pytest.raises(ec.EngineControlError, match="workload"):
        ec.engine_argv(paths, "tiny", "bogus", 4)
    with pytest.raises(ec.EngineControlError, match="rate"):
        ec.engine_argv(paths, "tiny", "synthetic", 0)
    with pytest.raises(ec.EngineControlError, match="outside the run directory"):
        ec.engine_argv(paths, "/etc", "synthetic", 1)
    (tmp_path / "ckpt").mkdir()
    assert ec.engine_argv(paths, "ckpt", "synthetic", 1)[5] == str((tmp_path / "ckpt").resolve())


def test_launch_status_stop_roundtrip(tmp_path):
    paths = RunPaths(tmp_path / "run")
    assert not ec.engine_status(paths).is_running
    # A stand-in long-running process: launch() is what start_engine uses for the real engine.
    argv = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    pid = ec.launch(paths, argv)
    try:
        status = ec.engine_status(paths)
        assert status.is_running and status.pid == pid
        assert json.loads(paths.pid_file.read_text())["argv"] == argv
        with pytest.raises(ec.EngineControlError, match="already running"):
            ec.launch(paths, argv)
        message = ec.stop_engine(paths, timeout_s=5)
        assert f"pid {pid} stopped" in message
        assert not ec.engine_status(paths).is_running and not paths.pid_file.exists()
    finally:
        if ec.engine_status(paths).is_running:
            os.killpg(pid, 9)


def test_dead_engine_reported_not_running(tmp_path):
    paths = RunPaths(tmp_path)
    pid = ec.launch(paths, [sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while ec.engine_status(paths).is_running and time.monotonic() < deadline:
        time.sleep(0.05)
    status = ec.engine_status(paths)
    assert not status.is_running and status.pid == pid
    assert "nothing to stop" in ec.stop_engine(paths)


def test_recycled_pid_is_not_our_engine(tmp_path):
    paths = RunPaths(tmp_path)
    paths.pid_file.write_text(json.dumps({"pid": os.getpid(), "argv": ["python", "-m", "engine", "serve"]}))
    status = ec.engine_status(paths)
    assert not status.is_running and "another program" in status.note


def test_an_engine_started_from_the_dashboard_logs_each_line_once(tmp_path):
    paths = RunPaths(tmp_path / "run")
    ec.start_engine(paths, "tiny", "synthetic", 4.0)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "serving tiny" not in _log(paths):
            time.sleep(0.2)
        assert "stopped" in ec.stop_engine(paths, timeout_s=30)
    finally:
        if ec.engine_status(paths).is_running:
            ec.stop_engine(paths, timeout_s=5)
    lines = [line.split(" ", 2)[-1] for line in _log(paths).splitlines() if "chunkscope." in line]
    assert any(line.startswith("INFO chunkscope.serve: serving tiny") for line in lines), lines
    assert any("run finished after" in line for line in lines), lines
    assert len(lines) == len(set(lines)), f"engine.log lines written twice: {lines}"


def _log(paths: RunPaths) -> str:
    return paths.engine_log.read_text(errors="replace") if paths.engine_log.exists() else ""


@pytest.mark.parametrize("typed", ["x" * 5000, "a/" * 3000])
def test_an_impossible_model_path_is_a_message(tmp_path, typed):
    with pytest.raises(ec.EngineControlError, match="model: "):
        ec.engine_argv(RunPaths(tmp_path), typed, "synthetic", 1)
