"""The Live page shows the engine's state now (from its heartbeat) when ticks stop: queue, KV, the blocker."""
from __future__ import annotations

import json
import sqlite3
import time

from dashboard.heartbeat_view import describe, live_state

from test_status_banner import engine_like_process  # noqa: F401  (fixture)

BLOCKER = "head request 310 needs 8 KV blocks, cap is 4 (kv_blocks_cap lever; ...)"
BLOCKED = {"state": "serving", "pid": 4242, "run_id": 2, "tick": 1234, "num_waiting": 77, "num_active": 0,
           "num_prefilling": 0, "kv_blocks_used": 0, "kv_blocks_usable": 4, "kv_blocks_cap": 4,
           "ssm_slots_used": 0, "ssm_slots_total": 32, "is_blocked": True, "blocker": BLOCKER}


def test_live_state_decisions():
    now = 1000.0
    fresh = {**BLOCKED, "updated_at": now - 0.5}
    state = live_state(fresh, 2, True, 40.0, now=now)
    assert state.is_blocked and state.blocker == BLOCKER and state.counters["num_waiting"] == 77
    assert state.counters["kv_blocks_total"] == 4
    assert describe(state).startswith(f"Engine blocked at tick 1234: {BLOCKER}. (77 waiting, 0 decoding, KV 0 / 4")
    assert live_state(fresh, 1, True, 40.0, now=now) is None                       # another run
    assert live_state(fresh, 2, False, 40.0, now=now) is None                      # engine gone
    assert live_state({**fresh, "updated_at": now - 10}, 2, True, 40.0, now=now) is None   # stale heartbeat
    moving = {**fresh, "is_blocked": False, "blocker": None}
    assert live_state(moving, 2, True, 0.2, now=now) is None                       # ticks current
    idle = live_state(moving, 2, True, 5.0, now=now)
    assert idle is not None and not idle.is_blocked and describe(idle).startswith("Engine idle at tick 1234")


def test_live_page_names_the_blocker_and_shows_the_queue_now(app, run_fixture, tmp_path, engine_like_process):  # noqa: F811
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "telemetry.db"
    db.write_bytes(run_fixture.db.read_bytes())
    conn = sqlite3.connect(db)
    conn.execute("UPDATE runs SET status = 'running', started_at = ? WHERE run_id = 2", (time.time() - 600,))
    conn.commit()
    conn.close()
    (run_dir / "engine_status.json").write_text(json.dumps({**BLOCKED, "pid": engine_like_process,
                                                            "updated_at": time.time()}))
    at = app(None, run_dir=run_dir, run_id=2)
    assert any(BLOCKER in e.value and "77 waiting" in e.value for e in at.error), [e.value for e in at.error]
    metrics = {m.label: m.value for m in at.metric}
    assert "waiting" in metrics, (metrics, [i.value for i in at.info], [w.value for w in at.warning])
    assert metrics["waiting"] == "77" and metrics["KV blocks"] == "0 / 4" and metrics["tick"] == "1234"
    assert metrics["decode tok/s"] == "0.0"
    assert not any("no tick has arrived" in w.value for w in at.warning)   # the heartbeat says why instead


def test_an_ended_run_claims_no_rate(app):
    at = app(None)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["decode tok/s"] == "—" and metrics["prefill tok/s"] == "—"
    assert any("counters are from its last tick" in c.value for c in at.caption)
