"""A ``kv_blocks_cap`` below what the queue head needs: the engine waits (no spin) and says why."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from engine.scheduler.stall import HeadNeeds, blocker
from telemetry.engine_status import read_engine_status
from telemetry.levers import defaults, write_levers_file

from serve_process import kill_quietly, query, scalar, start_serve, stop, wait_for

sys.path.insert(0, str(Path(__file__).parents[2] / "reliability"))
from reliability_helpers import cpu_seconds  # noqa: E402

MAX_BLOCKED_CPU_SHARE = 0.25   # a loop re-stepping at once holds a whole core (share ~1.0); waiting is ~0.01


def needs(**overrides) -> HeadNeeds:
    base = dict(request_id=310, chunk_tokens=128, blocks_needed=8, num_free=4, num_used=0, num_blocks=512,
                cap=4, ssm_free=4, ssm_slots=32)
    return HeadNeeds(**{**base, **overrides})


def test_blocker_names_the_cap_the_free_blocks_or_the_slots():
    assert blocker(needs()).startswith("head request 310 needs 8 KV blocks, cap is 4 (kv_blocks_cap lever")
    assert blocker(needs(cap=None, num_free=3, num_used=509)) == \
        "head request 310 needs 8 KV blocks, 3 free of 512 usable (509 in use)"
    assert blocker(needs(cap=20, num_free=3, num_used=17)) == \
        "head request 310 needs 8 KV blocks, 3 free of 20 usable (17 in use)"
    assert blocker(needs(ssm_free=0)) == "head request 310 waits for an SSM slot (all 32 in use)"
    assert blocker(needs(num_free=8)) is None


def test_a_cap_below_the_heads_need_blocks_without_spinning_and_the_heartbeat_names_it(tmp_path):
    run_dir = tmp_path / "run"
    db = run_dir / "telemetry.db"
    proc = start_serve(run_dir, "--rate", "20", "--seed", "3")
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM ticks") , "first ticks", proc)
        write_levers_file(run_dir / "levers.json", 1, defaults().replace(kv_blocks_cap=1))
        status = wait_for(lambda: (s := read_engine_status(run_dir)) and s.get("is_blocked") and s,
                          "the heartbeat to report the stall", proc, timeout_s=60)
        assert "cap is 1" in status["blocker"] and status["blocker"].startswith("head request ")
        assert status["kv_blocks_cap"] == 1 and status["num_waiting"] >= 1
        # The heartbeat can run ahead of the writer's last batch (flushed every 50-200 ms): read the
        # newest tick once two reads half a second apart agree.
        ticks_blocked = None
        while ticks_blocked != (newest := scalar(db, "SELECT max(tick) FROM ticks")):
            ticks_blocked = newest
            time.sleep(0.5)
        cpu_before, wall_before = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(3.0)
        share = (cpu_seconds(proc.pid) - cpu_before) / (time.monotonic() - wall_before)
        assert share < MAX_BLOCKED_CPU_SHARE, f"blocked engine used {share:.2f} of a core"
        assert scalar(db, "SELECT max(tick) FROM ticks") == ticks_blocked   # really no progress
        stalls = query(db, "SELECT * FROM events WHERE kind = 'stalled'")
        assert len(stalls) == 1 and "cap is 1" in stalls[0]["detail"]
        # Raising the cap again lets the queue move: the stall clears and ticks resume.
        write_levers_file(run_dir / "levers.json", 2, defaults())
        wait_for(lambda: scalar(db, "SELECT count(*) FROM events WHERE kind = 'stall_cleared'"),
                 "the stall to clear", proc, timeout_s=30)
        wait_for(lambda: scalar(db, "SELECT max(tick) FROM ticks") > ticks_blocked + 5, "ticks again", proc)
        status, stderr = stop(proc, signal.SIGTERM)
        assert status == 0, stderr
        assert stderr.count("no progress possible") == 1
    finally:
        kill_quietly(proc)

