"""Expert-parallel failures: a killed or hung rank ends the run (failed, store intact, no process
left) within the stated timeout; a mismatched start fails at start with a message."""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.ep_process import PROMPT, REPO_ROOT, clean_env, engine, is_running, kill_group, rank_pids

EP_TIMEOUT_S = 4.0
# Stated bound (docs/expert-parallel.md): a dead rank is noticed at the next collective (about a second), a hung one
# after --ep-timeout; then rank 0 closes the store and the ranks within a few seconds.
EXIT_MARGIN_S = 8.0


def _start_serving(run_dir: Path) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    stderr = open(run_dir / "serve.stderr", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", "tiny-moe", "--run-dir", str(run_dir), "--rate", "30",
         "--duration", "300", "--ep", "2", "--ep-timeout", str(EP_TIMEOUT_S), "--kv-blocks", "64"],
        cwd=REPO_ROOT, env=clean_env(CHUNKSCOPE_MAX_PREFILL_TOKENS="32"), stdout=subprocess.DEVNULL,
        stderr=stderr, start_new_session=True)


def _wait_for_ticks(db: Path, proc: subprocess.Popen, count: int = 30, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "serve exited before the fault"
        if db.exists():
            try:
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                ticks = conn.execute("SELECT count(*) FROM ticks WHERE path != 'idle'").fetchone()[0]
                conn.close()
                if ticks >= count:
                    return
            except sqlite3.OperationalError:
                pass
        time.sleep(0.2)
    raise AssertionError("serving did not reach its ticks")


def _check_failed_run(run_dir: Path, proc: subprocess.Popen, fault_at: float, bound_s: float,
                      pids: dict[str, int]) -> str:
    try:
        proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"rank 0 still running {bound_s:.0f}s after the fault") from None
    took = time.monotonic() - fault_at
    stderr = (run_dir / "serve.stderr").read_text()
    assert proc.returncode == 3, stderr[-3000:]
    assert "run failed" in stderr and "expert-parallel" in stderr
    deadline = time.monotonic() + 5
    while any(is_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(pid) for pid in pids.values()), "a rank process outlived the run"
    conn = sqlite3.connect(run_dir / "telemetry.db")
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT status FROM runs").fetchone()[0] == "failed"
    conn.close()
    from dashboard.queries.runs import list_runs
    reason = list_runs(run_dir / "telemetry.db")["failure reason"].iloc[0]   # what the Runs page shows
    assert "expert-parallel" in reason, reason
    print(f"rank 0 and every rank gone {took:.2f}s after the fault")
    return stderr


def test_sigkill_of_rank_1_ends_the_run_failed_with_no_process_left(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_serving(run_dir)
    try:
        pids = rank_pids(run_dir)
        _wait_for_ticks(run_dir / "telemetry.db", proc)
        os.kill(pids["1"], signal.SIGKILL)
        fault_at = time.monotonic()
        stderr = _check_failed_run(run_dir, proc, fault_at, EP_TIMEOUT_S + EXIT_MARGIN_S, pids)
        assert "rank 1" in stderr or "peer rank" in stderr
    finally:
        kill_group(proc)


def test_a_hung_rank_is_noticed_within_the_timeout(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_serving(run_dir)
    try:
        pids = rank_pids(run_dir)
        _wait_for_ticks(run_dir / "telemetry.db", proc)
        os.kill(pids["1"], signal.SIGSTOP)  # alive, never answers
        fault_at = time.monotonic()
        stderr = _check_failed_run(run_dir, proc, fault_at, EP_TIMEOUT_S + EXIT_MARGIN_S, pids)
        assert f"{EP_TIMEOUT_S:g} s" in stderr
    finally:
        kill_group(proc)


def test_killing_rank_0_takes_its_ranks_with_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_serving(run_dir)
    try:
        pids = rank_pids(run_dir)
        _wait_for_ticks(run_dir / "telemetry.db", proc, count=5)
        os.kill(pids["0"], signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + EP_TIMEOUT_S + EXIT_MARGIN_S
        while is_running(pids["1"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(pids["1"]), "rank 1 outlived rank 0"
    finally:
        kill_group(proc)


def test_ranks_with_different_checkpoints_fail_at_start(tmp_path):
    """torchrun-style start (RANK / WORLD_SIZE / MASTER_* set): rank 1 was given another checkpoint."""
    from engine.model.embedded import checkpoint_dir_of
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-moe"
    shutil.copytree(checkpoint_dir_of("tiny-moe"), other)
    tensors = load_file(other / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [subprocess.Popen([sys.executable, "-m", "engine", "generate", "--model", model, "--prompt-ids", PROMPT,
                               "--max-tokens", "4", "--ep", "2", "--threads", "1"], cwd=REPO_ROOT,
                              env=clean_env(RANK=str(rank), **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
             for rank, model in ((0, "tiny-moe"), (1, str(other)))]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2, err[-2000:]
        assert "different checkpoint or settings" in err


def test_a_world_size_that_does_not_divide_the_experts_fails_at_start():
    done = engine("generate", "--model", "tiny-moe", "--prompt-ids", PROMPT, "--ep", "3", timeout_s=120)
    assert done.returncode == 2
    assert "divisible by 3" in done.stderr and "has 8" in done.stderr


@pytest.mark.parametrize("model", ["tiny"])
def test_expert_parallelism_of_a_dense_checkpoint_is_refused(model):
    done = engine("generate", "--model", model, "--prompt-ids", PROMPT, "--ep", "2", timeout_s=120)
    assert done.returncode == 2 and "mixture-of-experts" in done.stderr


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
