"""``./run.sh`` starts engine + dashboard on 127.0.0.1:$PORT with $RUN_DIR, and SIGTERM stops both."""
from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, what: str, proc: subprocess.Popen, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"./run.sh exited ({proc.returncode}) before {what}")
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def health_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def run_status(db: Path) -> str | None:
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            row = conn.execute("SELECT status, (SELECT count(*) FROM ticks) FROM runs ORDER BY run_id DESC").fetchone()
    except sqlite3.Error:
        return None
    return f"{row[0]}:{row[1]}" if row else None


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
def test_run_sh_serves_live_engine_and_dashboard_and_stops_both(tmp_path):
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("./run.sh needs the project's .venv (./run.sh setup creates it)")
    port, api_port, run_dir = free_port(), free_port(), tmp_path / "run"
    env = {**os.environ, "PORT": str(port), "API_PORT": str(api_port), "RUN_DIR": str(run_dir)}
    proc = subprocess.Popen(["./run.sh"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: health_ok(port), "the dashboard's health endpoint", proc)
        db = run_dir / "telemetry.db"
        first = wait_until(lambda: (s := run_status(db)) and s.startswith("running:") and int(s[8:]) > 0 and s,
                           "a running engine writing ticks", proc)
        wait_until(lambda: int(run_status(db)[8:]) > int(first[8:]), "ticks still advancing", proc)
        with socket.socket() as probe:  # bound to loopback only
            assert probe.connect_ex(("127.0.0.1", port)) == 0
        import httpx   # the engine's API answers beside the chat workload
        reply = httpx.post(f"http://127.0.0.1:{api_port}/v1/completions", timeout=30,
                           json={"model": "tiny-chat", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        children = children_of(proc.pid)
        assert len(children) == 2, children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for child in children:
            assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text()
        assert run_status(db).startswith("finished:")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
