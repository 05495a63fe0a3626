"""The telemetry store's disk fills up or is read-only: the engine keeps serving and says so loudly.

"Disk full" is real: the database lives on a tiny tmpfs (the run dir holds a
symlink to it) and a ballast file eats the rest, so SQLite gets ENOSPC.
"Read-only" is a tmpfs remounted read-only. Linux refuses to remount a file
system read-only while a file on it is open for writing, so a store cannot be
made read-only *under* a running writer; the read-only case therefore starts
the engine on an already read-only store (and, as a second case, a read-only
run dir). Both need root for ``mount``; elsewhere they are skipped with that reason.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from reliability_helpers import cpu_seconds, query, wait_for

MAX_IDLE_CPU_SHARE = 0.5   # a spinning retry loop would hold a whole core (share ~1.0)


def _mount_tmpfs(directory: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path):
    mounted: list[Path] = []

    def mount(name: str, size: str = "4m") -> Path:
        directory = tmp_path / name
        _mount_tmpfs(directory, size)
        mounted.append(directory)
        return directory

    yield mount
    for directory in mounted:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def _fill(directory: Path) -> Path:
    """Write a ballast file until the file system is full."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    return ballast


def test_disk_full_engine_keeps_serving_reports_loudly_does_not_spin_and_loses_nothing(start_engine, tmp_path, tmpfs):
    store = tmpfs("store", "4m")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "telemetry.db").symlink_to(store / "telemetry.db")
    engine = start_engine("--rate", "1", "--kv-blocks", "64", run_dir=run_dir)
    engine.wait_status(lambda s: s["tick"] >= 3 and s["flushed_events"] > 0)
    assert (store / "telemetry.db-wal").exists(), "SQLite must keep its -wal beside the real file"

    ballast = _fill(store)
    failing = engine.wait_status(lambda s: s["telemetry"] == "failing", 60, "status telemetry=failing")
    assert "full" in failing["telemetry_error"]
    assert "is failing" in engine.output() and "database or disk is full" in engine.output()
    later = engine.wait_status(lambda s: s["tick"] >= failing["tick"] + 5 and s["num_done"] > failing["num_done"],
                               60, "requests completing while the store is full")
    assert later["telemetry"] == "failing"

    cpu_before, wall_before = cpu_seconds(engine.pid), time.monotonic()
    time.sleep(3)
    share = (cpu_seconds(engine.pid) - cpu_before) / (time.monotonic() - wall_before)
    assert share < MAX_IDLE_CPU_SHARE, f"engine used {share:.2f} of a core at 1 request/s with a full disk"

    ballast.unlink()
    recovered = engine.wait_status(lambda s: s["telemetry"] == "ok", 30, "telemetry recovered after space freed")
    assert recovered["telemetry_error"] is None and recovered["num_dropped"] == 0
    assert "recovered" in engine.output()
    assert engine.stop() == 0
    db = run_dir / "telemetry.db"
    assert query(db, "PRAGMA integrity_check") == [("ok",)]
    (count, distinct, high), = query(db, "SELECT count(*), count(DISTINCT tick), max(tick) FROM ticks")
    assert count == distinct == high + 1 >= later["tick"], "the batches that failed were retried, none lost"
    assert query(db, "SELECT status, num_dropped FROM runs") == [("finished", 0)]
    print(f"\ndisk full: failing at tick {failing['tick']}, served to tick {later['tick']} while full "
          f"({later['num_done'] - failing['num_done']} requests done), CPU {share:.2f} core, "
          f"{count} ticks stored gapless, 0 dropped")


def test_read_only_store_at_start_engine_serves_without_telemetry(start_engine, tmp_path, tmpfs):
    store = tmpfs("store_ro", "4m")
    subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "telemetry.db").symlink_to(store / "telemetry.db")
    engine = start_engine("--rate", "4", "--kv-blocks", "64", run_dir=run_dir)
    status = engine.wait_status(lambda s: s["tick"] >= 5, what="ticks with a read-only store")
    assert status["telemetry"] == "failing" and status["run_id"] is None
    assert "read-only" in status["telemetry_error"].lower() or "unable to open" in status["telemetry_error"]
    assert "telemetry disabled, engine keeps serving" in engine.output()
    assert engine.stop() == 0
    assert "Traceback" not in engine.output()


def test_read_only_run_dir_engine_serves_and_logs_to_stderr(start_engine, tmp_path, tmpfs):
    run_dir = tmpfs("run_ro", "1m")
    subprocess.run(["mount", "-o", "remount,ro", str(run_dir)], check=True)
    engine = start_engine("--requests", "3", "--rate", "50", "--kv-blocks", "64", run_dir=run_dir,
                          log_path=tmp_path / "engine.stderr")
    assert engine.proc.wait(timeout=120) == 0, engine.output()[-2000:]
    engine.close()
    out = engine.output()
    assert "logging to stderr only" in out and "telemetry disabled" in out
    assert "cannot write the engine status file" in out
    ticks = int(out.rsplit("run finished after ", 1)[1].split()[0])
    assert ticks >= 3, "the three requests were served"
    assert "Traceback" not in out
