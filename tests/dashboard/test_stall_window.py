"""The Live timeline's window outlives the last forward: a stall and the lever changes made while
the engine was blocked stay in view (issue 29, item 4)."""
from __future__ import annotations

import json
import sqlite3

from dashboard.queries.live import timeline_window
from telemetry.events import EVENT_STALL_CLEARED, EVENT_STALLED


def _blocked_copy(real_run_dir, tmp_path, *, cleared: bool):
    db = tmp_path / "telemetry.db"
    db.write_bytes(real_run_dir.db.read_bytes())
    conn = sqlite3.connect(db)
    run_id, tick, end_ns = conn.execute("SELECT run_id, tick, t_ns + duration_ns FROM ticks "
                                        "ORDER BY run_id DESC, tick DESC LIMIT 1").fetchone()
    stall_ns, lever_ns, clear_ns = end_ns + 1_000_000, end_ns + 40_000_000_000, end_ns + 65_000_000_000
    conn.execute("INSERT INTO events (run_id, tick, t_ns, kind, detail) VALUES (?, ?, ?, ?, ?)",
                 (run_id, tick, stall_ns, EVENT_STALLED, json.dumps({"blocker": "head request 9 needs 3 KV "
                                                                                 "blocks, cap is 1"})))
    conn.execute("INSERT INTO lever_changes (run_id, tick, t_ns, name, old, new, source, status) "
                 "VALUES (?, ?, ?, 'kv_blocks_cap', '1', '0', 'file', 'applied')", (run_id, tick, lever_ns))
    if cleared:
        conn.execute("INSERT INTO events (run_id, tick, t_ns, kind, detail) VALUES (?, ?, ?, ?, '{}')",
                     (run_id, tick, clear_ns, EVENT_STALL_CLEARED))
    conn.commit()
    conn.close()
    return db, run_id, stall_ns, lever_ns, clear_ns


def test_a_cleared_stall_after_the_last_forward_is_in_the_window(real_run_dir, tmp_path):
    db, run_id, stall_ns, lever_ns, clear_ns = _blocked_copy(real_run_dir, tmp_path, cleared=True)
    win = timeline_window(db, run_id, 120.0)
    assert win.end_ms == clear_ns / 1e6                       # not the last forward's end
    assert lever_ns / 1e6 in set(win.lever_changes["t_ms"])   # the change made while blocked is drawn
    (spell,) = win.stalls.itertuples()
    assert (spell.start_ms, spell.end_ms, spell.is_open) == (stall_ns / 1e6, clear_ns / 1e6, False)
    assert "cap is 1" in spell.blocker


def test_an_open_stall_runs_to_now_from_the_heartbeat(real_run_dir, tmp_path):
    db, run_id, stall_ns, lever_ns, _ = _blocked_copy(real_run_dir, tmp_path, cleared=False)
    assert timeline_window(db, run_id, 10.0).end_ms == lever_ns / 1e6
    now_ms = lever_ns / 1e6 + 5_000
    win = timeline_window(db, run_id, 10.0, open_end_ms=now_ms)
    assert win.end_ms == now_ms and win.start_ms == now_ms - 10_000
    assert list(win.stalls["end_ms"]) == [now_ms] and list(win.stalls["is_open"]) == [True]


def test_the_heartbeat_gives_the_open_stalls_end_in_coarse_steps():
    from dashboard.heartbeat_view import live_state, open_stall_end_ms

    status = {"state": "serving", "run_id": 1, "is_blocked": True, "blocker": "cap is 1", "updated_at": 100.0,
              "run_t_ns": 65_300_000_000}
    state = live_state(status, 1, True, 30.0, now=101.0)
    assert state.run_ms == 66_300.0 and open_stall_end_ms(state) == 66_000.0
    assert open_stall_end_ms(live_state({**status, "is_blocked": False}, 1, True, 30.0, now=101.0)) is None
