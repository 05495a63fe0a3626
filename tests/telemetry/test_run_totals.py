"""Whole-run totals on the runs row: kept by the writer per batch, equal to the rows at every flush."""
from __future__ import annotations

import sqlite3

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from telemetry import events as ev
from telemetry import run_totals
from telemetry.snapshot import TimeWindow, take_snapshot
from telemetry.writer import TelemetryWriter

from telemetry_factories import make_run_started

PATHS = (ev.PATH_MIXED, ev.PATH_PREFILL, ev.PATH_DECODE, ev.PATH_IDLE)


def _stored(db_path, run_id) -> dict:
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    return dict(conn.execute("SELECT * FROM runs WHERE run_id = ?", [run_id]).fetchone())


def _from_rows(db_path, run_id) -> dict:
    sql, num_binds = run_totals.totals_sql()
    conn = sqlite3.connect(db_path)
    values = conn.execute(sql, [run_id] * num_binds).fetchone()
    return dict(zip(run_totals.COLUMNS, values))


def _event(kind: int, i: int, path: str, n: int):
    if kind == 0:
        return ev.Tick(tick=i, t_ns=1000 * i, path=path, duration_ns=n * 7, num_prefill_tokens=n,
                       num_decode_tokens=i % 5)
    if kind == 1:
        return ev.ChunkDecision(tick=i, t_ns=1000 * i, request_id=i % 4, length=n, path=path)
    if kind == 2:
        return ev.Preemption(tick=i, t_ns=1000 * i, victim_request_id=i % 4, blocks_freed=n)
    if kind == 3:
        return ev.TokenEvent(tick=i, t_ns=1000 * i, request_id=i % 4, index=i, token_id=n)
    if kind == 4:       # upserted: a request moves through states, several times in one batch too
        return ev.RequestRecord(tick=i, t_ns=1000 * i, request_id=n % 9, status=STATUSES[(i + n) % len(STATUSES)],
                                prompt_len=n, prefix_hit_tokens=(n * i) % (n + 1))
    return ev.StreamEvent(tick=i, t_ns=1000 * i)                      # counted in no total


STATUSES = ev.REQUEST_STATUSES
events_strategy = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(PATHS), st.integers(0, 300)),
                           max_size=120)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=events_strategy, batch=st.integers(1, 40), flush_every=st.integers(1, 60))
def test_totals_equal_the_rows_at_every_flush(tmp_path_factory, events, batch, flush_every):
    db_path = tmp_path_factory.mktemp("totals") / "t.db"
    writer = TelemetryWriter(db_path, max_batch=batch, queue_size=max(batch, 200))
    run_id = writer.start_run(make_run_started())
    assert run_totals.from_row(_stored(db_path, run_id)) == run_totals.zeros()
    for i, (kind, path, n) in enumerate(events):
        writer.emit(_event(kind, i, path, n))
        if i % flush_every == 0:
            assert writer.flush()
            assert run_totals.from_row(_stored(db_path, run_id)) == _from_rows(db_path, run_id)
    writer.close()
    stored = run_totals.from_row(_stored(db_path, run_id))
    assert stored == _from_rows(db_path, run_id)
    assert stored["num_ticks"] == sum(kind == 0 for kind, _, _ in events)
    assert stored["num_requests"] == len({n % 9 for kind, _, n in events if kind == 4})


def test_older_runs_fall_back_and_snapshots_recompute(tmp_path):
    db_path = tmp_path / "t.db"
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started())
        for i in range(50):
            writer.emit(ev.Tick(tick=i, t_ns=i * 1_000_000, path=PATHS[i % 4], duration_ns=10,
                                num_prefill_tokens=i))
            writer.emit(ev.ChunkDecision(tick=i, t_ns=i * 1_000_000, length=i, path=PATHS[i % 2]))
    # A run written before the totals existed has NULLs: readers must not trust a partial count.
    conn = sqlite3.connect(db_path)
    conn.execute("UPDATE runs SET num_ticks = NULL, num_chunks = NULL")
    conn.commit()
    assert run_totals.from_row(_stored(db_path, run_id)) is None
    # A windowed snapshot keeps ticks 10..29 and its totals say so.
    dest = tmp_path / "snap.db"
    take_snapshot(db_path, run_id, dest, TimeWindow(since_ns=10_000_000, until_ns=30_000_000))
    totals = run_totals.from_row(_stored(dest, run_id))
    assert totals == _from_rows(dest, run_id)
    assert totals["num_ticks"] == 20 and totals["num_chunks"] == 20
    assert totals["num_prefill_tokens"] == sum(range(10, 30))
    assert totals["last_tick_end_ns"] == 29_000_000 + 10


def test_snapshot_of_a_store_without_the_columns(tmp_path):
    db_path = tmp_path / "old.db"
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started())
        writer.emit(ev.Tick(tick=1, t_ns=5, path=ev.PATH_MIXED, duration_ns=3, num_decode_tokens=2))
    conn = sqlite3.connect(db_path)
    for column in run_totals.COLUMNS:        # what a store from before the totals looks like
        conn.execute(f"ALTER TABLE runs DROP COLUMN [{column}]")
    conn.commit()
    dest = tmp_path / "snap.db"
    take_snapshot(db_path, run_id, dest)
    totals = run_totals.from_row(_stored(dest, run_id))
    assert totals["num_ticks"] == 1 and totals["num_mixed_ticks"] == 1 and totals["last_tick_end_ns"] == 8


def test_every_status_is_counted_by_exactly_one_request_total():
    counted = [s for statuses in run_totals.REQUEST_STATES.values() for s in statuses]
    assert sorted(counted) == sorted(ev.REQUEST_STATUSES)
    assert set(run_totals.REQUEST_STATES) <= set(run_totals.REQUEST_TOTALS)
