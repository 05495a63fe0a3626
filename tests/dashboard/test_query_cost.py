"""Whole-run views must cost about the same on a run four times longer.

Cost is counted in SQLite virtual-machine steps (a progress handler on every
read-only connection the dashboard opens), not in seconds: deterministic on a
shared machine, and it sees a full pass over a run's rows however fast the disk.
The sample sizes are shrunk so that both runs saturate them.
"""
from __future__ import annotations

import dataclasses

import pytest

import synthetic_run
from dashboard.queries import db as dashboard_db
from dashboard.queries import chunks as queries_chunks
from dashboard.queries import live as queries_live
from dashboard.queries import prefix as queries_prefix
from dashboard.queries import runs as queries_runs
from telemetry import run_totals

SMALL = dataclasses.replace(synthetic_run.SimConfig(), num_requests=300, seed=3)
LARGE = dataclasses.replace(SMALL, num_requests=1200)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    out = {}
    for name, cfg in (("small", SMALL), ("large", LARGE)):
        path = tmp_path_factory.mktemp(name) / "telemetry.db"
        out[name] = (path, synthetic_run.write_run(path, cfg))
    return out


@pytest.fixture
def count_steps(monkeypatch):
    monkeypatch.setattr(queries_live, "WHOLE_RUN_REQUESTS", 100)
    monkeypatch.setattr(queries_live, "ITL_SAMPLE_TOKENS", 1_000)
    monkeypatch.setattr(queries_live, "RECENT_REQUESTS", 100)
    monkeypatch.setattr(queries_live, "ITL_RECENT_TOKENS", 1_000)
    monkeypatch.setattr(queries_runs, "ROOFLINE_RECENT_TICKS", 500)
    real_connect = dashboard_db.connect_ro

    def measure(fn, *args) -> int:
        steps = [0]

        def counting_connect(path):
            conn = real_connect(path)

            def on_progress() -> int:
                steps[0] += 1
                return 0          # 0 = keep going
            conn.set_progress_handler(on_progress, 100)
            return conn
        monkeypatch.setattr(dashboard_db, "connect_ro", counting_connect)
        try:
            fn(*args)
        finally:
            monkeypatch.setattr(dashboard_db, "connect_ro", real_connect)
        return steps[0] * 100
    return measure


def _row_count(path, table) -> int:
    return dashboard_db.query_one(path, f"SELECT COUNT(*) AS n FROM [{table}]")["n"]


def _chunk_page(path, run_id):
    min_tick, _ = queries_chunks.scope_start(path, run_id, newest=500)
    flt = queries_chunks.ChunkFilter(min_tick=min_tick)
    queries_chunks.chunk_count(path, run_id, flt)
    queries_chunks.chunk_table(path, run_id, flt, 500)
    queries_chunks.length_histogram(path, run_id, flt)
    queries_chunks.mix_share(path, run_id, flt)


def _live_prefix_strip(path, run_id):
    scope = queries_prefix.recent_scope(path, run_id, newest=100)
    assert scope.num_requests == 100
    queries_prefix.hit_ratio_over_time(path, run_id, scope=scope)
    queries_prefix.totals(path, run_id, scope)
    queries_prefix.miss_reasons(path, run_id, scope)
    queries_prefix.snapshot_counts(path, run_id, scope)


@pytest.mark.parametrize("view", ["run_metrics", "latency_whole_run", "latency_recent", "chunk_page",
                                  "live_prefix_strip", "roofline_by_path"])
def test_whole_run_views_do_not_scale_with_the_run(stores, count_steps, view):
    (small, small_id), (large, large_id) = stores["small"], stores["large"]
    assert _row_count(large, "ticks") > 3.5 * _row_count(small, "ticks")     # the run really is ~4x longer
    fn = {"run_metrics": queries_runs.run_metrics,
          "latency_whole_run": lambda p, r: queries_live.latency_percentiles(p, r, is_recent=False),
          "latency_recent": queries_live.latency_percentiles,
          "chunk_page": _chunk_page, "live_prefix_strip": _live_prefix_strip,
          "roofline_by_path": queries_runs.roofline_by_path}[view]
    small_steps, large_steps = count_steps(fn, small, small_id), count_steps(fn, large, large_id)
    assert large_steps < 1.25 * small_steps, (view, small_steps, large_steps)


def test_the_measure_sees_a_whole_run_pass(stores, count_steps, monkeypatch):
    """Without the writer's totals, run_metrics falls back to aggregating the rows: cost ~ run length."""
    (small, small_id), (large, large_id) = stores["small"], stores["large"]
    real_from_row = run_totals.from_row
    monkeypatch.setattr(run_totals, "from_row", lambda row: None)
    small_steps, large_steps = count_steps(queries_runs.run_metrics, small, small_id), \
        count_steps(queries_runs.run_metrics, large, large_id)
    assert large_steps > 2 * small_steps, (small_steps, large_steps)   # 2.4x here; the rows grew 3.8x
    # ...and the fallback's numbers are the stored totals' numbers.
    from_rows = queries_runs.run_metrics(large, large_id)
    monkeypatch.setattr(run_totals, "from_row", real_from_row)
    stored = queries_runs.run_metrics(large, large_id)
    assert stored == from_rows
    assert stored["preemptions"] == _row_count(large, "preemptions") > 0
