"""SQL layer details the page tests do not reach: bucketing, lifecycle phases, search parsing."""
import pandas as pd
import pytest

from dashboard.queries import live as queries_live
from dashboard.lifecycle import request_phases
from dashboard.queries.ids import IdSelection
from dashboard.queries.requests import BadSearch, parse_search


def test_timeline_buckets_in_sql_past_the_raw_limit(run_fixture, monkeypatch):
    raw = queries_live.timeline_window(run_fixture.db, run_fixture.run1, 10.0)
    assert not raw.is_bucketed and len(raw.forwards) == raw.num_forwards
    monkeypatch.setattr(queries_live, "MAX_RAW_FORWARDS", 50)
    bucketed = queries_live.timeline_window(run_fixture.db, run_fixture.run1, 10.0)
    assert bucketed.is_bucketed and "end_ms" in bucketed.forwards
    assert bucketed.forwards["num_ticks"].sum() == raw.num_forwards
    by_path = bucketed.forwards.groupby("path")["num_ticks"].sum().to_dict()
    assert by_path == raw.forwards["path"].value_counts().to_dict()


def test_latency_itl_matches_token_gaps(run_fixture):
    tokens = run_fixture.of("TokenEvent")
    gaps = []
    last = {}
    for t in tokens:
        if t.request_id in last:
            gaps.append((t.t_ns - last[t.request_id]) / 1e6)
        last[t.request_id] = t.t_ns
    gaps.sort()
    lat = queries_live.latency_percentiles(run_fixture.db, run_fixture.run1, is_recent=False).set_index("metric")
    assert lat.loc["ITL", "count"] == len(gaps)
    assert lat.loc["ITL", "p50_ms"] == pytest.approx(gaps[(len(gaps) * 50 + 99) // 100 - 1])
    assert lat.loc["ITL", "p99_ms"] == pytest.approx(gaps[(len(gaps) * 99 + 99) // 100 - 1])


def test_phases_from_events_with_preemption():
    reqs = pd.DataFrame([{"request_id": 4, "status": "finished", "arrival_ns": 0, "admitted_ns": 1e6,
                          "first_token_ns": 3e6, "finished_ns": 9e6, "error": None, "finish_reason": "eos"}])
    events = pd.DataFrame({"request_id": [4] * 7, "t_ns": [0, 1e6, 3e6, 4e6, 6e6, 7e6, 9e6],
                           "kind": ["arrived", "admitted", "first_token", "preempted", "admitted", "first_token",
                                    "finished"], "detail": [None] * 6 + ["eos"]})
    phases = request_phases(reqs, events, end_ms=20.0)
    assert list(phases["phase"]) == ["queued", "prefilling", "decoding", "preempted", "prefilling", "decoding",
                                     "finished"]
    assert list(phases["start_ms"]) == [0, 1, 3, 4, 6, 7, 9]
    assert phases.iloc[-1]["detail"] == "eos"


def test_an_ending_preemption_and_a_cancel_close_their_requests():
    # This engine's preemption ends the request (the reference's rule): no re-admission follows.
    reqs = pd.DataFrame([
        {"request_id": 1, "status": "preempted", "arrival_ns": 0, "admitted_ns": 1e6, "first_token_ns": 2e6,
         "finished_ns": 5e6, "error": "preempted: KV cache exhausted", "finish_reason": "error"},
        {"request_id": 2, "status": "cancelled", "arrival_ns": 0, "admitted_ns": None, "first_token_ns": None,
         "finished_ns": 3e6, "error": "cancelled: client went away", "finish_reason": "cancelled"}])
    events = pd.DataFrame({"request_id": [1, 1, 1, 1, 2, 2], "t_ns": [0, 1e6, 2e6, 5e6, 0, 3e6],
                           "kind": ["arrived", "admitted", "first_token", "preempted", "arrived", "cancelled"],
                           "detail": [None, None, None, "preempted: KV cache exhausted", None,
                                      "cancelled: client went away"]})
    phases = request_phases(reqs, events, end_ms=20.0)
    one = phases[phases["request_id"] == 1]
    assert list(one["phase"]) == ["queued", "prefilling", "decoding", "preempted"]
    assert one.iloc[-1]["end_ms"] == 5.0 and one.iloc[-1]["detail"] == "preempted: KV cache exhausted"
    assert list(phases[phases["request_id"] == 2]["phase"]) == ["queued", "cancelled"]
    no_events = request_phases(reqs, events.iloc[:0], end_ms=20.0)
    assert list(no_events["phase"]) == ["queued", "prefilling", "decoding", "preempted", "queued", "cancelled"]
    assert "in progress" not in set(no_events["detail"].dropna())


def test_phases_fall_back_to_row_and_close_in_flight():
    reqs = pd.DataFrame([{"request_id": 1, "status": "decoding", "arrival_ns": 0, "admitted_ns": 2e6,
                          "first_token_ns": 5e6, "finished_ns": None, "error": None, "finish_reason": None}])
    empty = pd.DataFrame(columns=["request_id", "kind", "t_ns", "detail"])
    phases = request_phases(reqs, empty, end_ms=12.0)
    assert list(phases["phase"]) == ["queued", "prefilling", "decoding"]
    assert phases.iloc[-1]["end_ms"] == 12.0


@pytest.mark.parametrize("text,expected", [("", None), ("12", IdSelection((12,))), ("3, 7", IdSelection((3, 7))),
                                           ("10-20", IdSelection((), ((10, 20),)))])
def test_parse_search(text, expected):
    assert parse_search(text) == expected


@pytest.mark.parametrize("text", ["abc", "5-", "9-3", "1;DROP TABLE runs"])
def test_parse_search_rejects(text):
    with pytest.raises(BadSearch):
        parse_search(text)


def test_prefix_hit_buckets_and_miss_reasons(run_fixture):
    from dashboard.queries import prefix as queries_prefix

    admitted = [r for r in run_fixture.final_requests().values() if r.admitted_ns is not None]
    buckets = queries_prefix.hit_ratio_over_time(run_fixture.db, run_fixture.run1, num_buckets=7)
    assert len(buckets) <= 7 and buckets["num_requests"].sum() == len(admitted)
    assert buckets["hit_tokens"].sum() == sum(r.prefix_hit_tokens for r in admitted)
    assert buckets["bucket_s"].is_monotonic_increasing
    assert ((buckets["hit_ratio"] >= 0) & (buckets["hit_ratio"] <= 1)).all()
    first = min(admitted, key=lambda r: r.arrival_ns)
    assert buckets["bucket_s"].iloc[0] == pytest.approx(first.arrival_ns / 1e9)
    reasons = queries_prefix.miss_reasons(run_fixture.db, run_fixture.run1).set_index("reason")["num_requests"]
    expected = {}
    for r in admitted:
        if r.prefix_miss_reason:
            expected[r.prefix_miss_reason] = expected.get(r.prefix_miss_reason, 0) + 1
    assert reasons.to_dict() == expected
    # the synthetic run emits no snapshot events: every kind is present, at zero
    assert queries_prefix.snapshot_counts(run_fixture.db, run_fixture.run1) == dict.fromkeys(
        queries_prefix.SNAPSHOT_KINDS, 0)


def test_prefix_recent_scope_covers_the_newest_requests(run_fixture):
    from dashboard.queries import prefix as queries_prefix

    final = run_fixture.final_requests()
    assert queries_prefix.recent_scope(run_fixture.db, run_fixture.run1) == queries_prefix.WHOLE_RUN  # 30 < 2,000
    scope = queries_prefix.recent_scope(run_fixture.db, run_fixture.run1, newest=10)
    newest = max(final)
    assert scope.min_request_id == newest - 10 and scope.label == "newest 10 requests"
    recent = [r for r in final.values() if r.request_id > newest - 10 and r.admitted_ns is not None and r.prompt_len]
    assert scope.min_tick == min(r.arrival_tick for r in final.values() if r.request_id > newest - 10)
    totals = queries_prefix.totals(run_fixture.db, run_fixture.run1, scope)
    assert totals["num_requests"] == len(recent)
    assert totals["hit_tokens"] == sum(r.prefix_hit_tokens for r in recent)
    buckets = queries_prefix.hit_ratio_over_time(run_fixture.db, run_fixture.run1, scope=scope)
    assert buckets["num_requests"].sum() == len(recent)
    whole = queries_prefix.totals(run_fixture.db, run_fixture.run1)
    assert whole["num_requests"] > totals["num_requests"]
