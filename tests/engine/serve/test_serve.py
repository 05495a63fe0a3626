"""``python -m engine serve`` as a real process: SIGTERM, crash recovery, the levers file, the stored rows."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from telemetry import events as ev
from telemetry.levers import defaults, write_levers_file

from serve_process import kill_quietly, max_tick, query, scalar, start_serve, stop, wait_for

CAP_RULES = {ev.CAP_REMAINING, ev.CAP_MAX_PREFILL, ev.CAP_SLICE_BUDGET, ev.CAP_WHOLE_PROMPT,
             ev.CAP_SSM_TAIL, ev.CAP_BLOCK_ALIGN, ev.CAP_TAIL_SPLIT, ev.CAP_ENCODER_BUDGET, ev.CAP_IMAGE_WHOLE}
BLOCKERS = {ev.BLOCK_BISECT, ev.BLOCK_NO_DECODES, ev.BLOCK_EXPERT_PARALLEL, ev.BLOCK_SPECULATION}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One endless served run: a garbage levers file, then bisect_no_mix on, then SIGTERM."""
    run_dir = tmp_path_factory.mktemp("live")
    db = run_dir / "telemetry.db"
    levers_path = run_dir / "levers.json"
    proc = start_serve(run_dir, "--rate", "8", "--seed", "11")
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM chunks WHERE path='mixed'"), "a mixed chunk", proc)
        # A torn write, put in place atomically so the watcher sees exactly this content.
        (run_dir / "garbage.tmp").write_text('{"version": 1, "levers": {"bisect_no_mix": tru')
        os.replace(run_dir / "garbage.tmp", levers_path)
        rejected = wait_for(lambda: query(db, "SELECT * FROM lever_changes WHERE status='rejected'"),
                            "the rejection", proc)[0]
        # Long enough for the watcher's periodic stat check to look at the same bad file again.
        tick_after_rejection = max_tick(db)
        wait_for(lambda: max_tick(db) >= tick_after_rejection + 15, "ticks after the rejection", proc)
        write_levers_file(levers_path, 2, defaults().replace(bisect_no_mix=True))
        applied = wait_for(lambda: query(db, "SELECT * FROM lever_changes WHERE status='applied'"),
                           "the bisect_no_mix change", proc)
        tick = applied[0]["tick"]
        wait_for(lambda: scalar(db, "SELECT count(*) FROM chunks WHERE tick > ? AND decode_width > 0", (tick,))
                 and max_tick(db) >= tick + 10, "chunks while bisect_no_mix is on", proc)
        status, stderr = stop(proc, signal.SIGTERM)
    finally:
        kill_quietly(proc)
    return SimpleNamespace(db=db, run_dir=run_dir, status=status, stderr=stderr, rejected=rejected,
                           applied=applied, tick=tick)


def test_sigterm_drains_and_marks_the_run_finished(live):
    assert live.status == 0, live.stderr
    run = query(live.db, "SELECT * FROM runs")[0]
    assert run["status"] == "finished" and run["finished_at"] is not None
    # Drained: every request ended, none left looking alive.
    statuses = {r["status"] for r in query(live.db, "SELECT status FROM requests")}
    assert statuses and statuses <= set(ev.END_STATUSES)
    cut = query(live.db, "SELECT error, finish_reason FROM requests WHERE status = 'cancelled'")
    assert all(r["error"].startswith("cancelled:") and r["finish_reason"] == "cancelled" for r in cut)
    assert not query(live.db, "SELECT error FROM requests WHERE error LIKE 'cancelled:%' AND status != 'cancelled'")
    # The final tick's rows made it to the store before exit.
    assert scalar(live.db, "SELECT count(*) FROM ticks") == max_tick(live.db) + 1


def test_a_run_killed_with_sigkill_is_marked_crashed_at_the_next_start(tmp_path):
    db = tmp_path / "telemetry.db"
    proc = start_serve(tmp_path, "--rate", "8")
    try:
        wait_for(lambda: max_tick(db) >= 3, "a few ticks", proc)
        status, _ = stop(proc, signal.SIGKILL)
    finally:
        kill_quietly(proc)
    assert status == -signal.SIGKILL
    assert scalar(db, "SELECT status FROM runs WHERE run_id = 1") == "running"
    again = start_serve(tmp_path, "--requests", "1", "--rate", "100")
    try:
        status = again.wait(timeout=120)
    finally:
        kill_quietly(again)
    assert status == 0
    assert {r["run_id"]: r["status"] for r in query(db, "SELECT run_id, status FROM runs")} == \
        {1: "crashed", 2: "finished"}
    assert "marked runs [1] as crashed" in (tmp_path / "engine.log").read_text()


def test_a_garbage_levers_file_is_rejected_once_and_the_old_values_stay(live):
    rejections = query(live.db, "SELECT * FROM lever_changes WHERE status = 'rejected'")
    assert len(rejections) == 1, rejections
    assert "levers.json" in rejections[0]["reason"] and "JSON" in rejections[0]["reason"]
    assert rejections[0]["tick"] is not None
    # Nothing was applied by the bad file: chunks between it and the good file still mix.
    applied_before = query(live.db, "SELECT * FROM lever_changes WHERE status = 'applied' AND tick < ?",
                           (live.rejected["tick"],))
    assert applied_before == []
    mixed_after_rejection = scalar(live.db, "SELECT count(*) FROM chunks WHERE path = 'mixed' AND tick >= ? "
                                            "AND tick < ?", (live.rejected["tick"], live.tick))
    blocked_by_bisect = scalar(live.db, "SELECT count(*) FROM chunks WHERE mix_blocker = 'bisect_no_mix' "
                                        "AND tick < ?", (live.tick,))
    assert blocked_by_bisect == 0
    chunks_between = scalar(live.db, "SELECT count(*) FROM chunks WHERE decode_width > 0 AND tick >= ? "
                                     "AND tick < ?", (live.rejected["tick"], live.tick))
    assert mixed_after_rejection == chunks_between  # every chunk with decodes still mixed


def test_a_lever_written_mid_run_is_applied_at_a_tick_and_mixing_stops(live):
    assert len(live.applied) == 1
    change = live.applied[0]
    assert (change["name"], change["old"], change["new"], change["source"], change["file_version"]) == \
        ("bisect_no_mix", "false", "true", "file", 2)
    assert change["tick"] > live.rejected["tick"]
    after = query(live.db, "SELECT * FROM chunks WHERE tick >= ?", (change["tick"],))
    assert after and all(c["path"] == ev.PATH_PREFILL for c in after)
    assert all(c["mix_blocker"] == ev.BLOCK_BISECT and c["can_mix"] == 0 for c in after)
    ticks_after = {t["path"] for t in query(live.db, "SELECT path FROM ticks WHERE tick >= ?", (change["tick"],))}
    assert ev.PATH_MIXED not in ticks_after
    assert scalar(live.db, "SELECT count(*) FROM chunks WHERE path = 'mixed' AND tick < ?", (change["tick"],)) > 0


def test_every_tick_and_chunk_row_has_the_contract_fields(live):
    ticks = query(live.db, "SELECT * FROM ticks ORDER BY tick")
    assert [t["tick"] for t in ticks] == list(range(len(ticks)))
    for t in ticks:
        assert t["run_id"] == 1 and t["t_ns"] >= 0 and t["duration_ns"] > 0
        assert t["path"] in (ev.PATH_MIXED, ev.PATH_PREFILL, ev.PATH_DECODE)
        for name in ("num_prefill_tokens", "num_decode_tokens", "num_active", "num_waiting", "num_prefilling",
                     "kv_blocks_used", "ssm_slots_used", "num_finished"):
            assert t[name] is not None and t[name] >= 0, (name, t)
        assert t["kv_blocks_total"] == 512 and t["ssm_slots_total"] == 32
        assert (t["num_prefill_tokens"] > 0) == (t["path"] != ev.PATH_DECODE)
    assert [t["t_ns"] for t in ticks] == sorted(t["t_ns"] for t in ticks)
    chunks = query(live.db, "SELECT * FROM chunks ORDER BY id")
    assert chunks
    for c in chunks:
        for name in ("run_id", "tick", "t_ns", "request_id", "offset", "length", "prompt_len", "is_last",
                     "cap_rule", "max_prefill_tokens", "path", "can_mix", "decode_width", "duration_ns",
                     "outcome", "num_preempted"):
            assert c[name] is not None, (name, c)
        assert c["cap_rule"] in CAP_RULES and c["path"] in (ev.PATH_MIXED, ev.PATH_PREFILL)
        assert 1 <= c["length"] and c["offset"] + c["length"] <= c["prompt_len"]
        assert c["is_last"] == (c["offset"] + c["length"] == c["prompt_len"])
        assert (c["mix_blocker"] is None) == bool(c["can_mix"])
        assert c["mix_blocker"] is None or c["mix_blocker"] in BLOCKERS
        assert c["slice_budget"] is None  # always_mixed is off
        assert c["outcome"] == "ok" and c["duration_ns"] > 0
    tick_path = {t["tick"]: t["path"] for t in ticks}
    assert all(tick_path[c["tick"]] == c["path"] for c in chunks)
