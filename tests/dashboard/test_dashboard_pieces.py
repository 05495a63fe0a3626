"""Dashboard pieces without a browser: lever state (file versus telemetry), the per-rank lanes' bars, the
fragment timing log, and the queries that must answer on stores older than their columns."""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from dashboard import fragment_timing, lever_state
from dashboard.figures.rank_lanes import RANK_COLUMNS, empty_rank_forwards, rank_lane_traces
from dashboard.queries import api as api_queries
from dashboard.queries import grammar as grammar_queries
from dashboard.queries.totals import run_totals_of
from telemetry.levers import LEVERS_BY_NAME, LeversError, read_levers_file, defaults
from telemetry import run_totals


def changes_frame(rows: list[dict]) -> pd.DataFrame:
    columns = ["name", "status", "new", "tick", "source", "reason", "file_version", "id"]
    return pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=columns)


def test_pending_file_reads_missing_good_and_broken_files(tmp_path):
    path = tmp_path / "levers.json"
    missing = lever_state.read_pending(path)
    assert missing.version is None and missing.overrides == {} and missing.error is None
    assert missing.values == defaults().as_dict()
    version = lever_state.write_change(path, "max_prefill_tokens", 64, telemetry_version=7)
    assert version == 8, "above the engine's reported version, so it is never taken for an old file"
    assert lever_state.write_change(path, "bisect_no_mix", True) == 9
    pending = lever_state.read_pending(path)
    assert pending.version == 9 and pending.overrides == {"max_prefill_tokens": 64, "bisect_no_mix": True}
    assert pending.values["max_prefill_tokens"] == 64
    assert read_levers_file(path, defaults()).values.max_prefill_tokens == 64, "the engine reads what we wrote"
    path.write_text("{not json")
    broken = lever_state.read_pending(path)
    assert broken.version is None and broken.error and broken.overrides == {}


def test_a_bad_change_never_reaches_the_file(tmp_path):
    path = tmp_path / "levers.json"
    lever_state.write_change(path, "max_prefill_tokens", 32)
    before = path.read_bytes()
    with pytest.raises(LeversError, match="unknown lever 'nope'"):
        lever_state.write_change(path, "nope", 1)
    with pytest.raises(LeversError):
        lever_state.write_change(path, "max_prefill_tokens", -5)
    assert path.read_bytes() == before


def test_lever_rows_tell_in_sync_pending_and_rejected():
    pending = lever_state.PendingFile(5, {"max_prefill_tokens": 64, "bisect_no_mix": True,
                                          "preempt_policy": "newest"}, {}, None)
    changes = changes_frame([
        {"name": "max_prefill_tokens", "status": "applied", "new": "64", "tick": 12, "source": "file", "id": 3,
         "file_version": 5},
        {"name": "bisect_no_mix", "status": "rejected", "new": "true", "tick": 9, "source": "file", "id": 4,
         "reason": "not now", "file_version": 5},
        {"name": "bisect_no_mix", "status": "applied", "new": "false", "tick": 2, "source": "file", "id": 1,
         "file_version": 2},
    ])
    rows = {r.name: r for r in lever_state.lever_rows(pending, changes, start_levers={"max_prefill_tokens": 256})}
    assert list(rows) == list(LEVERS_BY_NAME), "every lever, in the registry's order"
    prefill = rows["max_prefill_tokens"]
    assert (prefill.state, prefill.applied, prefill.applied_tick, prefill.shown) == ("in sync", 64, 12, 64)
    mix = rows["bisect_no_mix"]
    assert mix.state == "rejected" and mix.applied is False and mix.shown is True
    assert mix.rejection == "not now (tick 9, file version 5)"
    policy = rows["preempt_policy"]
    assert policy.state == "pending" and policy.applied == LEVERS_BY_NAME["preempt_policy"].default
    assert policy.applied_tick is None and policy.rejection is None
    table = lever_state.rows_table(list(rows.values())).set_index("lever")
    assert table.loc["bisect_no_mix", "pending"] == "true" and table.loc["bisect_no_mix", "applied"] == "false"
    assert table.loc["preempt_policy", "source"] == "run start" and table.loc["preempt_policy", "rejection"] == ""
    assert str(table["applied at tick"].dtype) == "Int64"
    assert lever_state.max_file_version(changes) == 5
    assert lever_state.max_file_version(changes_frame([])) is None


def test_an_old_rejection_does_not_shadow_a_newer_application():
    pending = lever_state.PendingFile(3, {"max_prefill_tokens": 128}, {}, None)
    changes = changes_frame([
        {"name": "max_prefill_tokens", "status": "rejected", "new": "-1", "tick": 1, "id": 1, "reason": "bad",
         "file_version": 1},
        {"name": "max_prefill_tokens", "status": "applied", "new": "96", "tick": 4, "id": 2, "file_version": 2},
    ])
    row = next(r for r in lever_state.lever_rows(pending, changes, {}) if r.name == "max_prefill_tokens")
    assert (row.state, row.rejection, row.applied) == ("pending", None, 96)


def test_rank_lanes_draw_each_part_of_each_forward_on_its_rank_lane():
    forwards = pd.DataFrame({"rank": [1, 0, 1], "tick": [3, 3, 4], "start_ms": [10.0, 10.0, 20.0],
                             "broadcast_ms": [0.5, 0.0, 1.0], "expert_ms": [2.0, 3.0, 1.5],
                             "exchange_ms": [1.0, 0.5, 0.25], "forward_ms": [4.0, 4.0, 3.0]})
    traces, lanes, names = rank_lane_traces(forwards, top_y=-2.0)
    assert lanes == [-2.0, -3.0] and names == ["rank 0", "rank 1"]
    by_name = {t["name"]: t for t in traces}
    assert list(by_name) == ["rank broadcast", "rank forward", "rank experts", "rank exchange"]
    assert by_name["rank forward"]["y"].tolist() == [-3.0, -2.0, -3.0]
    assert by_name["rank broadcast"]["base"].tolist() == [9.5, 10.0, 19.0], "the wait ends where the forward starts"
    assert by_name["rank exchange"]["base"].tolist() == [12.0, 13.0, 21.5], "exchange drawn after the experts"
    assert by_name["rank experts"]["x"].tolist() == [2.0, 3.0, 1.5]
    assert all(t["customdata"].shape == (3, 6) for t in traces)
    assert rank_lane_traces(empty_rank_forwards(), 0.0) == ([], [], [])
    assert list(empty_rank_forwards()) == RANK_COLUMNS


def test_the_timing_log_records_every_run_even_a_raising_one(tmp_path, monkeypatch):
    log_file = tmp_path / "timing.log"
    monkeypatch.setattr(fragment_timing.log, "handlers", [])
    monkeypatch.setattr(fragment_timing.log, "level", logging.NOTSET)
    fragment_timing.configure_from_env({fragment_timing.ENV_LOG: str(log_file)})
    fragment_timing.configure_from_env({fragment_timing.ENV_LOG: str(log_file)})
    assert len(fragment_timing.log.handlers) == 1, "Streamlit re-runs app.py: one handler per process"

    @fragment_timing.timed("banner")
    def banner(x):
        return x * 2

    @fragment_timing.timed("stopped")
    def stopped():
        raise RuntimeError("rerun")

    assert banner(3) == 6 and banner.__name__ == "banner"
    with pytest.raises(RuntimeError):
        stopped()
    for handler in fragment_timing.log.handlers:
        handler.flush()
        handler.close()
    with log_file.open("a") as extra:
        extra.write("garbage line\n1.0 banner notanumber\n")
    timings = fragment_timing.read_timings(log_file)
    assert list(timings) == ["banner", "stopped"] and len(timings["banner"]) == 1 and len(timings["stopped"]) == 1
    assert all(0 <= s < 5 for values in timings.values() for s in values)
    assert fragment_timing.read_timings(tmp_path / "absent.log") == {}


def old_store(path: Path, with_source: bool = True) -> Path:
    """A store with the tables of an early schema: no grammar columns, no totals on the runs row."""
    conn = sqlite3.connect(path)
    conn.executescript(f"""
        CREATE TABLE runs (run_id INTEGER PRIMARY KEY, status TEXT);
        CREATE TABLE requests (run_id INTEGER, request_id INTEGER, status TEXT, arrival_ns INTEGER,
                               first_token_rules TEXT {', source TEXT' if with_source else ''});
        CREATE TABLE ticks (run_id INTEGER, tick INTEGER, duration_ns INTEGER);
        CREATE TABLE preemptions (run_id INTEGER, tick INTEGER);
        INSERT INTO runs VALUES (1, 'finished');
    """)
    conn.commit()
    conn.close()
    return path


def test_grammar_queries_answer_no_data_on_a_store_without_grammar_columns(tmp_path):
    db = old_store(tmp_path / "old.db")
    assert grammar_queries.summary(db, 1) is None
    marks = grammar_queries.marks(db, 1, [1, 2])
    assert marks.empty and list(marks) == ["request_id", "grammar_kind", "grammar_valid"]
    assert grammar_queries.marks(db, 1, []).empty


def test_api_activity_counts_sources_rates_and_rules(tmp_path):
    db = old_store(tmp_path / "api.db")
    conn = sqlite3.connect(db)
    conn.executemany("INSERT INTO requests VALUES (1, ?, 'finished', ?, ?, ?)", [
        (1, 1_000_000_000, "think_end,grammar", "api"), (2, 9_000_000_000, "grammar", "api"),
        (3, 9_500_000_000, None, None), (4, 9_800_000_000, "", "workload")])
    conn.execute("INSERT INTO requests VALUES (2, 1, 'finished', 0, 'x', 'api')")   # another run
    conn.commit()
    conn.close()
    activity = api_queries.api_activity(db, 1, end_ns=10_000_000_000, window_s=2.0)
    assert activity["by_source"] == {"api": 2, "workload": 2}, "no source recorded: the engine's workload"
    assert activity["api_rate"] == pytest.approx(0.5), "one API arrival in the last 2 s"
    assert activity["rules"] == {"grammar": 2, "think_end": 1} and activity["num_requests"] == 4
    assert api_queries.api_activity(db, 1, end_ns=0, window_s=0.0)["api_rate"] == 0.0


def test_run_totals_are_the_stored_sums_or_the_same_numbers_from_the_rows(tmp_path):
    import synthetic_run

    db = tmp_path / "telemetry.db"
    run_id = synthetic_run.write_run(db, synthetic_run.SimConfig(num_requests=6), status="finished")
    stored = run_totals_of(db, run_id)
    assert stored["num_ticks"] > 0 and stored["num_prefill_tokens"] > 0
    conn = sqlite3.connect(db)
    conn.execute(f"UPDATE runs SET {', '.join(f'{c} = NULL' for c in run_totals.COLUMNS)}")   # an older store
    conn.commit()
    conn.close()
    assert run_totals_of(db, run_id) == stored
    assert run_totals_of(db, run_id + 1) == run_totals.zeros(), "an unknown run: zero totals, never an error"


def test_the_encoder_lane_draws_runs_back_to_back_per_tick_and_hits_as_markers():
    from dashboard.figures.encoder_lane import empty_encoder_events, encoder_lane_traces
    from dashboard.figures.timeline import timeline_dict

    events = pd.DataFrame({"tick": [3, 3, 3, 5], "start_ms": [10.0, 10.0, 10.0, 30.0],
                           "kind": ["encoder_run", "encoder_run", "encoder_hit", "encoder_hit"],
                           "request_id": [1, 1, 1, 2], "tokens": [18, 64, 18, 64], "encoder_ms": [2.0, 5.0, 0.0, 0.0]})
    runs, hits = encoder_lane_traces(events, y=-1.0)
    assert runs["base"].tolist() == [10.0, 12.0] and runs["x"].tolist() == [2.0, 5.0]
    assert hits["x"].tolist() == [10.0, 30.0] and set(hits["y"].tolist()) == {-1.0}
    assert encoder_lane_traces(empty_encoder_events(), 0.0) == []
    empty = pd.DataFrame(columns=["start_ms", "dur_ms", "tick", "path", "num_prefill_tokens", "num_decode_tokens"])
    frames = [pd.DataFrame(columns=c) for c in (["t_ms", "kind", "stream", "event_name", "seq", "tick",
                                                 "target_stream", "gpu_elapsed_ms"], ["x0"], ["t_ms"], ["t_ms"])]
    figure = timeline_dict(empty, *frames, encoder=events)
    assert figure["layout"]["yaxis"]["ticktext"][-1] == "encoder"
    assert {"encoder run", "encoder cache hit"} <= {t.get("name") for t in figure["data"]}
