"""Helpers for expert-parallel tests: run the engine as real rank processes, find and clean up ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.engine.serve_process import REPO_ROOT

PROMPT = ",".join(str(5 + i) for i in range(33))


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def engine(*args: str, timeout_s: float = 180, **env: str) -> subprocess.CompletedProcess:
    """``python -m engine ARGS`` to completion (killed, with its rank children, past ``timeout_s``)."""
    proc = subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=REPO_ROOT, env=clean_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"engine {' '.join(args)} ran past {timeout_s}s:\n{err[-3000:]}")
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the process group the test started (ranks included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan nobody reaped is gone for our purpose)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def rank_pids(run_dir: Path, timeout_s: float = 120) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    path = run_dir / "ep_ranks.json"
    while time.monotonic() < deadline:
        if path.exists():
            return {rank: int(pid) for rank, pid in json.loads(path.read_text()).items()}
        time.sleep(0.1)
    raise AssertionError(f"no {path} after {timeout_s}s")


def tokens_by_request(db: Path) -> dict[int, list[int]]:
    import sqlite3
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute('SELECT request_id, token_id FROM tokens ORDER BY request_id, "index"').fetchall()
    finally:
        conn.close()
    out: dict[int, list[int]] = {}
    for request_id, token in rows:
        out.setdefault(request_id, []).append(token)
    return out
