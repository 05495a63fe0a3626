"""Helpers for the reliability suite: real engine processes on temporary run dirs, polled from outside.

An engine started here is ``python -m engine serve --model tiny`` exactly as a
user starts it; tests observe it only from outside: its status file
(``engine_status.json``), its log, and the telemetry database it writes.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120     # importing torch on a busy 2-core box takes 10-20 s


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def query(db_path: Path, sql: str, params=()):
    """One read through a fresh connection (as the dashboard reads: never the writer's)."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (clock ticks -> seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class EngineProcess:
    """``python -m engine serve`` on ``run_dir``; stdout+stderr go to ``log_path`` (outside tmpfs faults)."""

    def __init__(self, run_dir: Path, *args: str, log_path: Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path or self.run_dir.parent / f"{self.run_dir.name}.stderr"
        self.args = ["--model", "tiny", "--run-dir", str(self.run_dir), *args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", *self.args], cwd=REPO,
                                     env=child_env(), stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "engine_status.json").read_text())
        except (OSError, ValueError):
            return None

    def wait_status(self, predicate, timeout_s: float = START_TIMEOUT_S, what: str = "engine status"):
        def check():
            self.assert_alive()
            status = self.status()
            return status if status is not None and predicate(status) else None
        return wait_for(check, timeout_s, what)

    def wait_tick(self, at_least: int, timeout_s: float = START_TIMEOUT_S) -> dict:
        return self.wait_status(lambda s: s["tick"] >= at_least, timeout_s, f"tick >= {at_least}")

    def assert_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"engine exited with {self.proc.returncode}:\n{self.output()[-3000:]}")

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.close()

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
