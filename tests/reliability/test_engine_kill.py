"""kill -9 of a serving engine: the store stays sound, flushed rows stay, the next start says 'crashed'."""
from __future__ import annotations

import time

from reliability_helpers import REPO, query

FLUSH_INTERVAL_S = 0.05     # TelemetryWriter default: at most this much is in flight


def runs_page_statuses(run_dir, monkeypatch) -> dict:
    """run_id -> status as the dashboard's Runs page lists it, in a fresh AppTest session."""
    from streamlit.testing.v1 import AppTest

    from dashboard.paths import ENV_RUN_DIR
    monkeypatch.chdir(REPO)
    monkeypatch.setenv(ENV_RUN_DIR, str(run_dir))
    at = AppTest.from_file(str(REPO / "dashboard" / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("app_pages/runs.py").run()
    assert not at.exception, [e.value for e in at.exception]
    listing = at.dataframe[0].value
    return dict(zip(listing["run_id"].astype(int), listing["status"]))


def test_kill_9_mid_run_keeps_flushed_batches_and_next_start_marks_crashed(start_engine, tmp_path, monkeypatch):
    engine = start_engine("--rate", "20", "--kv-blocks", "64")
    engine.wait_tick(20)
    # A heartbeat taken well over one flush interval before the kill: everything it
    # counts was emitted before that interval began, so the writer had committed it.
    snapshot = engine.wait_status(lambda s: s["flushed_events"] > 0 and s["tick"] >= 20)
    time.sleep(max(0.3, 6 * FLUSH_INTERVAL_S))
    engine.kill9()

    db = engine.run_dir / "telemetry.db"
    assert query(db, "PRAGMA integrity_check") == [("ok",)]
    (count, distinct, low, high), = query(db, "SELECT count(*), count(DISTINCT tick), min(tick), max(tick) "
                                              "FROM ticks WHERE run_id = 1")
    assert count == distinct == high + 1 and low == 0, "ticks must be gapless from 0: no batch lost in the middle"
    assert count >= snapshot["tick"], f"ticks up to the heartbeat ({snapshot['tick']}) must all be stored"
    (num_events, status), = query(db, "SELECT num_events, status FROM runs WHERE run_id = 1")
    assert num_events >= snapshot["flushed_events"]
    print(f"\nkill -9: heartbeat tick {snapshot['tick']} / {snapshot['flushed_events']} flushed events; "
          f"stored {count} ticks / {num_events} events")
    assert status == "running"                        # nobody could close it
    assert runs_page_statuses(engine.run_dir, monkeypatch) == {1: "crashed"}, "dashboard: dead pid = crashed"
    assert query(db, "SELECT count(*) FROM chunks WHERE run_id = 1")[0][0] > 0

    again = start_engine("--requests", "1", "--rate", "50", run_dir=engine.run_dir,
                         log_path=tmp_path / "second.stderr")
    assert again.proc.wait(timeout=120) == 0, again.output()[-2000:]
    again.close()
    assert "marked runs [1] as crashed" in again.output()
    assert query(db, "SELECT run_id, status FROM runs ORDER BY run_id") == [(1, "crashed"), (2, "finished")]
    assert runs_page_statuses(engine.run_dir, monkeypatch) == {1: "crashed", 2: "finished"}
    assert query(db, "PRAGMA integrity_check") == [("ok",)]
