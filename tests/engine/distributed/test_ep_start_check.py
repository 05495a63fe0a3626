"""Ranks that disagree on their dtype (or shapes, or model) fail the run at the start handshake, as
``failed`` with the reason on the Runs page, instead of meeting a collective of mismatched sizes."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

from engine.distributed import handshake
from engine.distributed.exchange import EXCHANGES
from engine.distributed.worker import start_settings
from tests.engine.ep_process import REPO_ROOT, clean_env, kill_group

EP_TIMEOUT_S = 4.0
# Both ranks load the tiny MoE (a few seconds each on a shared core), then meet once: the failure
# must follow within the collective timeout and a few seconds of closing the store.
START_BOUND_S = 120.0


def _settings(**changed) -> dict:
    settings = start_settings(2, 24, 8, 16, "float32", "all_to_all", 64)
    return {**settings, **changed}


def test_the_handshake_has_one_size_whatever_the_settings():
    """The wire format never depends on a setting: a mismatch cannot turn into a size mismatch."""
    one = handshake.encode("ab" * 32, _settings())
    other = handshake.encode("cd" * 32, _settings(dtype="bfloat16", hidden_size=4096, kv_blocks=100000))
    assert one.shape == other.shape == (len(handshake.FIELDS),)
    assert handshake.disagreements([one.tolist(), one.tolist()]) == []
    found = handshake.disagreements([one.tolist(), other.tolist()])
    assert found[0] == "dtype: rank 0 float32, rank 1 bfloat16"
    assert [line.split(":")[0] for line in found] == ["dtype", "hidden size", "--kv-blocks", "checkpoint hash"]
    assert set(handshake.EXCHANGE_CODES) == set(EXCHANGES)   # every exchange has a code on the wire


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ranks_that_resolve_auto_to_different_dtypes_fail_the_run_with_the_reason(tmp_path):
    """torchrun-style: rank 0 stands in for an AVX2 CPU (``auto`` = float32), rank 1 for an AMX
    one (``auto`` = bfloat16), through the CPU test hook. The run row says failed, and why."""
    from dashboard.queries.runs import list_runs

    run_dir = tmp_path / "run"
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", "tiny-moe", "--run-dir",
                               str(run_dir), "--requests", "4", "--rate", "1000", "--kv-blocks", "24",
                               "--dtype", "auto", "--ep", "2", "--ep-timeout", str(EP_TIMEOUT_S), "--threads", "1"],
                              cwd=REPO_ROOT, env=clean_env(RANK=str(rank), CHUNKSCOPE_ASSUME_CPU=cpu, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank, cpu in ((0, "avx2"), (1, "amx"))]
    try:
        results = [p.communicate(timeout=START_BOUND_S) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    print(f"both ranks gone {time.monotonic() - started:.1f}s after they started")
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-2000:]   # a message and exit 2, never SIGABRT (-6) or a core dump
        assert "dtype: rank 0 float32, rank 1 bfloat16" in err
    conn = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
    assert conn.execute("SELECT status, json_extract(config, '$.dtype') FROM runs").fetchall() == [("failed", "float32")]
    assert conn.execute("SELECT count(*) FROM ticks WHERE path != 'idle'").fetchone()[0] == 0   # no forward ran
    conn.close()
    runs = list_runs(run_dir / "telemetry.db")
    assert runs["status"].tolist() == ["failed"] and runs["dtype"].tolist() == ["float32"]
    reason = runs["failure reason"].iloc[0]
    assert "different checkpoint or settings" in reason and "dtype: rank 0 float32, rank 1 bfloat16" in reason
