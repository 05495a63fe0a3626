"""Helpers for tests that run ``python -m engine serve`` as a real subprocess and read its store."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0   # importing torch on a loaded 2-core CI box is slow


def start_serve(run_dir: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Lever variables would change the run under test; the checkpoint cache location must stay.
    env = {k: v for k, v in env.items() if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    env.update(env_extra or {})
    run_dir.mkdir(parents=True, exist_ok=True)
    # stderr goes to a file: a pipe nobody drains could fill up and block the engine.
    with open(run_dir / "serve.stderr", "a") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir), *args],
            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    proc.stderr_path = run_dir / "serve.stderr"  # type: ignore[attr-defined]
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    return Path(proc.stderr_path).read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]


def query(db_path: Path, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    """Rows as dicts; an absent or not-yet-created store reads as no rows."""
    if not db_path.exists():
        return []
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params)]
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    finally:
        conn.close()


def scalar(db_path: Path, sql: str, params: tuple = ()) -> Any:
    rows = query(db_path, sql, params)
    return next(iter(rows[0].values())) if rows else None


def wait_for(condition: Callable[[], Any], what: str, proc: subprocess.Popen | None = None,
             timeout_s: float = START_TIMEOUT_S) -> Any:
    """Poll until ``condition()`` is truthy; fail with the engine's stderr if it died first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"serve exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{stderr_of(proc)}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def max_tick(db_path: Path) -> int:
    value = scalar(db_path, "SELECT max(tick) FROM ticks")
    return -1 if value is None else int(value)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> tuple[int, str]:
    """Send ``sig`` and wait; returns (exit status, stderr)."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"serve did not exit within {timeout_s:.0f}s of signal {sig}:\n{stderr_of(proc)}")
    return proc.returncode, stderr_of(proc)


def kill_quietly(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
