"""A short real engine run for the page tests: ``python -m engine serve`` on the tiny model.

Multi-turn workload (prefixes recur, so the prefix cache hits and misses with
reasons), a small KV cache (24 blocks: preemptions and rejections happen),
``ssm_tail_ckpt`` on from the environment, the test fault hook failing the
forwards of request ``FAULT_REQUEST`` (an error end state), and a levers-file write once the
serve loop is ticking (``bisect_no_mix`` on mid-run), so every page has real
rows of every kind. Expected numbers are read from the database with plain
SQL in the tests, never through the dashboard's queries.
"""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from telemetry.levers import write_levers_file

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 24
FLIP_AFTER_TICK = 30          # write the levers file once the loop has run this many ticks
TIMEOUT_S = 120.0
MID_RUN_LEVERS = {"bisect_no_mix": True}
FAULT_REQUEST = 6             # CHUNKSCOPE_FAULT_FORWARD: its forward raises, it ends as an error


@dataclass
class RealRun:
    run_dir: Path
    wall_s: float

    @property
    def db(self) -> Path:
        return self.run_dir / "telemetry.db"

    def rows(self, sql: str, params=()) -> list[tuple]:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def one(self, sql: str, params=()):
        return self.rows(sql, params)[0][0]


def _status_tick(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "engine_status.json").read_text()).get("tick") or 0)
    except (OSError, ValueError):
        return -1


def serve_argv(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
            "--workload", "multiturn", "--requests", str(NUM_REQUESTS), "--rate", "30", "--kv-blocks", "24"]


def run_engine(run_dir: Path) -> RealRun:
    """Serve to completion, flipping ``MID_RUN_LEVERS`` through the levers file on the way."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CHUNKSCOPE_SSM_TAIL_CKPT": "1",
           "CHUNKSCOPE_FAULT_FORWARD": str(FAULT_REQUEST)}
    start = time.monotonic()
    proc = subprocess.Popen(serve_argv(run_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        written = False
        while proc.poll() is None and time.monotonic() - start < TIMEOUT_S:
            if not written and _status_tick(run_dir) >= FLIP_AFTER_TICK:
                write_levers_file(run_dir / "levers.json", 1, MID_RUN_LEVERS)
                written = True
            time.sleep(0.05)
        if proc.poll() is None:
            raise AssertionError(f"engine serve did not finish within {TIMEOUT_S:g} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    if proc.returncode != 0:
        raise AssertionError(f"engine serve exited {proc.returncode}:\n{output[-3000:]}")
    if not written:
        raise AssertionError(f"the run ended before tick {FLIP_AFTER_TICK}; no mid-run lever change:\n{output}")
    return RealRun(run_dir, time.monotonic() - start)
