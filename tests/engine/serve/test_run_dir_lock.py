"""One engine per run directory: a second ``serve`` refuses with one line naming the running pid."""
from __future__ import annotations

from pathlib import Path

from telemetry.engine_status import read_engine_status

from serve_process import kill_quietly, scalar, start_serve, wait_for


def test_a_second_engine_on_a_run_dir_refuses_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    first = start_serve(run_dir, "--rate", "4")
    try:
        wait_for(lambda: scalar(run_dir / "telemetry.db", "SELECT count(*) FROM ticks"), "first ticks", first)
        second = start_serve(run_dir, "--rate", "4")
        assert second.wait(timeout=120) == 2
        lines = [line for line in Path(second.stderr_path).read_text().splitlines()
                 if line.strip() and "chunkscope" not in line]
        assert lines == [f"error: --run-dir {run_dir}: another engine (pid {first.pid}) is serving this directory; "
                         f"stop it first or pick another directory"]
        assert read_engine_status(run_dir)["pid"] == first.pid
        assert scalar(run_dir / "telemetry.db", "SELECT count(*) FROM runs") == 1
        assert first.poll() is None
    finally:
        kill_quietly(first)
