"""The Chrome trace of a run passes the structural validator, and the validator catches broken traces."""
from __future__ import annotations

import gzip
import json

import pytest

from telemetry import perfetto
from bundle_store import build_store
from trace_validator import validate_trace


@pytest.fixture
def trace(tmp_path):
    db = build_store(tmp_path)
    out = tmp_path / "trace.json.gz"
    num_events = perfetto.write_trace(db, out, run_id=2)
    data = json.loads(gzip.decompress(out.read_bytes()))
    assert len(data["traceEvents"]) == num_events
    return data


def _events(trace, ph, **match):
    return [e for e in trace["traceEvents"] if e["ph"] == ph and all(e.get(k) == v for k, v in match.items())]


def test_trace_passes_the_structural_validator(trace):
    assert validate_trace(trace) == []


def test_tracks_are_named_per_stream_plus_scheduler(trace):
    names = {e["args"]["name"] for e in _events(trace, "M", name="thread_name")}
    assert names == {"scheduler", "default", "prefill", "secondary"}
    assert _events(trace, "M", name="process_name")[0]["args"]["name"] == "chunkscope run 2"


def test_overlapping_slices_are_clamped_to_the_next_start(trace):
    ticks = sorted(_events(trace, "X", tid=perfetto.TRACKS["scheduler"]), key=lambda e: e["ts"])
    tick5 = next(e for e in ticks if e["args"]["tick"] == 5)
    assert tick5["args"]["clamped_from_us"] == 13_000
    assert tick5["ts"] + tick5["dur"] == pytest.approx(ticks[6]["ts"])
    chunks = [e for e in _events(trace, "X", tid=perfetto.TRACKS["prefill"]) if e["cat"] == "forward"]
    assert len(chunks) == 10 and sum("clamped_from_us" in e["args"] for e in chunks) == 5


def test_flows_join_each_record_to_its_wait_and_skip_orphans(trace):
    outs = [e for e in trace["traceEvents"] if e.get("flow_out")]
    ins = [e for e in trace["traceEvents"] if e.get("flow_in")]
    assert len(outs) == len(ins) == 10
    assert {e["bind_id"] for e in outs} == {e["bind_id"] for e in ins}
    assert all(e["tid"] == perfetto.TRACKS["prefill"] for e in outs)
    assert all(e["tid"] == perfetto.TRACKS["default"] for e in ins)
    orphan = next(e for e in trace["traceEvents"] if e.get("name") == "wait prefill_done #1000")
    assert "bind_id" not in orphan


def test_requests_are_async_slices_with_phases(trace):
    begins = _events(trace, "b", cat="request")
    lifetimes = [e for e in begins if e["name"].startswith("request ")]
    assert len(lifetimes) == 10
    open_request = next(e for e in lifetimes if e["id"] == "9")
    assert open_request["args"]["is_open"] is True
    assert {e["name"] for e in begins if e["id"] == "0"} == {"request 0", "queued", "prefill", "decode"}


def test_counters_and_instants(trace):
    assert len(_events(trace, "C", name="requests")) == len(_events(trace, "C", name="kv blocks")) == 40
    assert len(_events(trace, "i", cat="preemption")) == 2
    assert {e["name"] for e in _events(trace, "i", cat="lever")} == {
        "lever max_prefill_tokens applied", "lever bisect_no_mix applied", "lever slice_budget rejected"}


def _base():
    return [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "p"}},
            {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "t"}}]


@pytest.mark.parametrize("bad, expected", [
    ([{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10, "name": "a"},
      {"ph": "X", "pid": 1, "tid": 1, "ts": 5, "dur": 10, "name": "b"}], "partially overlaps"),
    ([{"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 1, "name": "a"}], "has no thread_name"),
    ([{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 1, "name": "a", "bind_id": "x", "flow_out": True}],
     "1 start(s), 0 end(s)"),
    ([{"ph": "C", "pid": 1, "ts": 0, "name": "c", "args": {"v": "3"}}], "non-numeric"),
    ([{"ph": "b", "pid": 1, "tid": 1, "ts": 0, "name": "r", "cat": "request", "id": "1"}], "never end"),
    ([{"ph": "b", "pid": 1, "tid": 1, "ts": 0, "name": "r", "cat": "request", "id": "1"},
      {"ph": "b", "pid": 1, "tid": 1, "ts": 1, "name": "q", "cat": "request", "id": "1"},
      {"ph": "e", "pid": 1, "tid": 1, "ts": 2, "name": "r", "cat": "request", "id": "1"}], "innermost"),
])
def test_validator_catches_broken_traces(bad, expected):
    problems = validate_trace({"traceEvents": _base() + bad})
    assert any(expected in p for p in problems), problems


def test_validator_accepts_nested_and_touching_slices():
    ok = [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10, "name": "a"},
          {"ph": "X", "pid": 1, "tid": 1, "ts": 2, "dur": 3, "name": "b"},
          {"ph": "X", "pid": 1, "tid": 1, "ts": 10, "dur": 0, "name": "c"},
          {"ph": "X", "pid": 1, "tid": 1, "ts": 10, "dur": 5, "name": "d"}]
    assert validate_trace({"traceEvents": _base() + ok}) == []
