import math
import random
import sqlite3

import pytest

from telemetry import events as ev
from telemetry.reader import TelemetryReader, TelemetryUnavailable
from telemetry.writer import TelemetryWriter

from telemetry_factories import make_run_started, one_of_each

SUMMARY_KEYS = {"requests", "finished", "errors", "preemptions", "mixed_chunks", "plain_chunks", "ticks",
                "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "prefix_hit_ratio", "lever_changes"}


def nearest_rank(values, p):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p * len(ordered) - 1e-9)) - 1]


@pytest.fixture
def scripted_run(db_path):
    """A small run with known numbers: 3 requests, 10 ticks, 2 mixed + 1 plain chunk."""
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started(levers={"max_prefill_tokens": 256, "bisect_no_mix": False}))
        for tick in range(10):
            writer.emit(ev.Tick(tick=tick, t_ns=tick * 100_000_000, duration_ns=50_000_000,
                                path=ev.PATH_MIXED if tick < 4 else ev.PATH_DECODE, num_prefill_tokens=10,
                                num_decode_tokens=2, kv_blocks_used=tick, kv_blocks_total=64))
        for path in (ev.PATH_MIXED, ev.PATH_MIXED, ev.PATH_PREFILL):
            writer.emit(ev.ChunkDecision(tick=0, t_ns=0, path=path,
                                         mix_blocker=None if path == ev.PATH_MIXED else ev.BLOCK_BISECT))
        # request 1: arrival 0, first token 10 ms, tokens every 5 ms; request 2: ttft 30 ms, error; 3 waiting
        writer.emit(ev.RequestRecord(tick=0, t_ns=0, request_id=1, status=ev.REQ_FINISHED, arrival_ns=0,
                                     first_token_ns=10_000_000, finished_ns=40_000_000, prompt_len=100,
                                     prefix_hit_tokens=50))
        writer.emit(ev.RequestRecord(tick=0, t_ns=0, request_id=2, status=ev.REQ_ERROR, arrival_ns=0,
                                     first_token_ns=30_000_000, prompt_len=100, error="boom"))
        writer.emit(ev.RequestRecord(tick=0, t_ns=0, request_id=3, status=ev.REQ_WAITING, prompt_len=0))
        for i in range(7):
            writer.emit(ev.TokenEvent(tick=i, t_ns=10_000_000 + i * 5_000_000, request_id=1, index=i))
        writer.emit(ev.Preemption(tick=5, t_ns=5, victim_request_id=2))
        writer.emit(ev.LeverChange(tick=3, t_ns=3, name="max_prefill_tokens", old=256, new=128, source="file"))
        writer.emit(ev.LeverChange(tick=4, t_ns=4, name="max_prefill_tokens", old=128, new=True,
                                   status="rejected", reason="expected int, got bool"))
    return db_path, run_id


def test_missing_and_empty_db_mean_no_telemetry_yet(tmp_path):
    for path in (tmp_path / "absent.db", tmp_path / "empty.db"):
        if path.name == "empty.db":
            path.write_bytes(b"")
        reader = TelemetryReader(path)
        assert reader.list_runs() == [] and reader.latest_run_id() is None
        assert reader.run_summary(1) is None and reader.events_after("ticks", 1) == []
        assert reader.window_aggregates(1, 0, None, 10) == [] and reader.lever_state(1) == {}
        assert reader.latency_percentiles(1)["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    sqlite3.connect(tmp_path / "schemaless.db").execute("CREATE TABLE other (x)")
    assert TelemetryReader(tmp_path / "schemaless.db").list_runs() == []
    assert not (tmp_path / "absent.db").exists()


def test_not_a_database_is_unavailable(tmp_path):
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(TelemetryUnavailable, match="garbage.db"):
        TelemetryReader(path).list_runs()


def test_locked_db_is_unavailable(db_path, scripted_run):
    locker = sqlite3.connect(db_path, isolation_level=None)
    locker.execute("PRAGMA journal_mode=DELETE")  # rollback journal: an exclusive lock blocks readers
    locker.execute("BEGIN EXCLUSIVE")
    locker.execute("UPDATE runs SET model = 'x'")
    try:
        with pytest.raises(TelemetryUnavailable, match="locked"):
            TelemetryReader(db_path, busy_timeout_ms=50).list_runs()
    finally:
        locker.execute("ROLLBACK")


def test_summary_has_contract_keys_and_known_values(scripted_run):
    db_path, run_id = scripted_run
    summary = TelemetryReader(db_path).run_summary(run_id)
    assert SUMMARY_KEYS <= set(summary)
    assert (summary["requests"], summary["finished"], summary["errors"]) == (3, 1, 1)
    assert (summary["mixed_chunks"], summary["plain_chunks"], summary["ticks"]) == (2, 1, 10)
    assert summary["preemptions"] == 1 and summary["lever_changes"] == 1 and summary["lever_rejections"] == 1
    assert summary["ttft_p50_ms"] == 10.0 and summary["ttft_p99_ms"] == 30.0
    assert summary["itl_p50_ms"] == 5.0
    assert summary["prefix_hit_ratio"] == 0.25
    assert summary["tokens_per_s"] == pytest.approx(7 / 0.95)  # 7 tokens over 0 .. 9*100ms+50ms
    assert summary["status"] == "finished"


def test_runs_listing(scripted_run):
    db_path, run_id = scripted_run
    reader = TelemetryReader(db_path)
    runs = reader.list_runs()
    assert [r["run_id"] for r in runs] == [run_id] == [reader.latest_run_id()]
    assert runs[0]["config"]["num_kv_blocks"] == 64  # JSON decoded


def test_events_after_tails_by_id(scripted_run):
    db_path, run_id = scripted_run
    reader = TelemetryReader(db_path)
    first = reader.events_after("ticks", run_id, 0, limit=4)
    assert [r["tick"] for r in first] == [0, 1, 2, 3]
    rest = reader.events_after("ticks", run_id, first[-1]["id"], limit=100)
    assert [r["tick"] for r in rest] == list(range(4, 10))
    assert reader.events_after("ticks", run_id + 1, 0) == []
    with pytest.raises(ValueError, match="cannot tail"):
        reader.events_after("runs; DROP TABLE runs", run_id)


def test_window_aggregates(scripted_run):
    db_path, run_id = scripted_run
    buckets = TelemetryReader(db_path).window_aggregates(run_id, 0, None, 500_000_000)
    assert [b["bucket_start_ns"] for b in buckets] == [0, 500_000_000]
    assert (buckets[0]["mixed"], buckets[0]["decode"], buckets[1]["decode"]) == (4, 1, 5)
    assert buckets[0]["tokens_per_s"] == pytest.approx(60 / 0.5)
    assert buckets[1]["kv_blocks_used_max"] == 9 and buckets[1]["kv_blocks_total"] == 64
    limited = TelemetryReader(db_path).window_aggregates(run_id, 200_000_000, 400_000_000, 100_000_000)
    assert [b["ticks"] for b in limited] == [1, 1]


def test_lever_state(scripted_run):
    db_path, run_id = scripted_run
    state = TelemetryReader(db_path).lever_state(run_id)
    assert state["bisect_no_mix"] == {"value": False, "tick": None, "source": "start", "file_version": None,
                                      "last_rejection": None}
    assert state["max_prefill_tokens"]["value"] == 128 and state["max_prefill_tokens"]["tick"] == 3
    assert state["max_prefill_tokens"]["last_rejection"]["value"] is True
    assert "bool" in state["max_prefill_tokens"]["last_rejection"]["reason"]


def test_chunk_blockers_and_requests(scripted_run):
    db_path, run_id = scripted_run
    reader = TelemetryReader(db_path)
    assert reader.chunk_blockers(run_id) == {None: 2, ev.BLOCK_BISECT: 1}
    assert [r["request_id"] for r in reader.requests(run_id, status=ev.REQ_ERROR)] == [2]
    assert len(reader.requests(run_id)) == 3


def test_percentiles_match_nearest_rank(db_path):
    rng = random.Random(3)
    ttfts, gaps = [], []
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started())
        for rid in range(40):
            ttft = rng.randrange(1, 10**8)
            ttfts.append(ttft)
            writer.emit(ev.RequestRecord(tick=0, t_ns=0, request_id=rid, arrival_ns=1000, first_token_ns=1000 + ttft,
                                         finished_ns=1000 + 2 * ttft))
            t = 0
            for index in range(rng.randrange(1, 12)):
                if index:
                    gap = rng.randrange(1, 10**7)
                    gaps.append(gap)
                    t += gap
                writer.emit(ev.TokenEvent(tick=index, t_ns=t, request_id=rid, index=index))
    lat = TelemetryReader(db_path).latency_percentiles(run_id)
    for p, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        assert lat["ttft"][key] == nearest_rank(ttfts, p) / 1e6
        assert lat["itl"][key] == nearest_rank(gaps, p) / 1e6
        assert lat["e2e"][key] == 2 * nearest_rank(ttfts, p) / 1e6
    assert lat["itl"]["count"] == len(gaps)


def test_every_event_kind_is_tailable_and_decoded(db_path):
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started())
        for event in one_of_each():
            writer.emit(event)
    reader = TelemetryReader(db_path)
    generic = reader.events_after("events", run_id)
    assert generic[0]["detail"] == {"num_drafts": 3, "nested": {"ok": True}}
    assert all(reader.events_after(t, run_id) for t in ("ticks", "chunks", "stream_events", "preemptions",
                                                      "request_events", "tokens", "lever_changes"))
