"""Queries behind the Live page: counters, the timeline window, latency percentiles.

Plain functions of (db path, run id, ...): aggregation happens in SQL and
every result is bounded (a time window, a LIMIT, or a handful of numbers), so
the cost does not grow with the length of the run.

Time convention: a tick's ``t_ns`` is when its forward started and
``duration_ns`` how long it took; charts use milliseconds since run start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dashboard.queries.db import percentile_sql, query_df, query_one
from dashboard.queries.totals import run_totals_of
from dashboard.words import ordinal, plural
from telemetry.events import EVENT_KV_QUANT_STATE
from dashboard.figures.encoder_lane import empty_encoder_events
from dashboard.figures.rank_lanes import empty_rank_forwards
from telemetry.events import EVENT_ENCODER_HIT, EVENT_ENCODER_RUN, EVENT_EP_FORWARD
from telemetry.stalls import MAX_STALL_EVENTS, STALL_KINDS, blocked_spells

MAX_RAW_FORWARDS = 4_000       # past this many forwards in the window, bucket them in SQL (a screen is ~1,500 px wide)
NUM_BUCKETS = 1_500
MAX_STREAM_EVENTS = 1_500
MAX_MARKERS = 500
MAX_RANK_FORWARDS = 4_000      # per-rank bars (ranks x forwards) drawn at most
ITL_RECENT_TOKENS = 20_000     # live ITL percentiles look at the newest tokens only
RECENT_REQUESTS = 2_000        # live TTFT / e2e percentiles: the newest requests only
ITL_SAMPLE_TOKENS = 10_000     # whole-run ITL: sample whole requests down to about this many tokens
WHOLE_RUN_REQUESTS = 2_000     # whole-run TTFT / e2e: sample request ids down to at most this many
NS_PER_MS = 1_000_000
STALL_COLUMNS = ["start_ms", "end_ms", "blocker", "is_open"]
KV_QUANT_EVENT = EVENT_KV_QUANT_STATE


@dataclass(frozen=True)
class TimelineWindow:
    forwards: pd.DataFrame         # raw per-tick rows, or bucketed rows (has end_ms)
    stream_events: pd.DataFrame
    links: pd.DataFrame
    preemptions: pd.DataFrame
    lever_changes: pd.DataFrame
    start_ms: float
    end_ms: float
    num_forwards: int              # forwards in the window before any bucketing
    is_bucketed: bool
    stream_events_capped: bool = False   # MAX_STREAM_EVENTS reached: older ones in the window not drawn
    kv_quant_changes: pd.DataFrame | None = None  # InnerQ calibration state changes in the window
    # Expert parallelism: each rank's share of each forward (empty otherwise), dashboard/figures/rank_lanes.py.
    rank_forwards: pd.DataFrame = field(default_factory=empty_rank_forwards)
    # Vision checkpoints: tower runs and encoder-cache hits (empty otherwise), dashboard/figures/encoder_lane.py.
    encoder: pd.DataFrame = field(default_factory=empty_encoder_events)
    # Spells the engine was blocked (start_ms, end_ms, blocker, is_open), dashboard/figures/stall_band.py.
    stalls: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=STALL_COLUMNS))


def latest_tick(db: Path, run_id: int) -> dict | None:
    return query_one(db, "SELECT * FROM ticks WHERE run_id = ? ORDER BY tick DESC LIMIT 1", [run_id])


def throughput(db: Path, run_id: int, end_ns: int, window_s: float) -> dict:
    """Tokens per second over the last ``window_s`` seconds of ticks."""
    start_ns = end_ns - int(window_s * 1e9)
    row = query_one(db, "SELECT COUNT(*) AS num_ticks, COALESCE(SUM(num_prefill_tokens), 0) AS prefill, "
                        "COALESCE(SUM(num_decode_tokens), 0) AS decode, MIN(t_ns) AS first_ns "
                        "FROM ticks WHERE run_id = ? AND t_ns >= ?", [run_id, start_ns]) or {}
    span_s = window_s if row.get("first_ns") is None else max(1e-9, (end_ns - row["first_ns"]) / 1e9)
    span_s = max(span_s, 1e-3)
    return {"num_ticks": row.get("num_ticks", 0), "prefill_tok_s": row.get("prefill", 0) / span_s,
            "decode_tok_s": row.get("decode", 0) / span_s, "span_s": span_s}


def _forwards(db: Path, run_id: int, start_ns: int, num_forwards: int, end_ns: int) -> tuple[pd.DataFrame, bool]:
    if num_forwards <= MAX_RAW_FORWARDS:
        frame = query_df(db, """
            SELECT t.tick, t.t_ns / 1e6 AS start_ms, t.duration_ns / 1e6 AS dur_ms, t.path,
                   t.num_prefill_tokens, t.num_decode_tokens,
                   t.roofline_ns * 1.0 / NULLIF(t.duration_ns, 0) AS roofline_share,
                   c.request_id, c.chunk_len, c.decode_width, c.cap_rule, c.mix_blocker
            FROM ticks t LEFT JOIN (
                SELECT tick, MIN(request_id) AS request_id, SUM(length) AS chunk_len,
                       MAX(decode_width) AS decode_width, MIN(cap_rule) AS cap_rule,
                       MIN(mix_blocker) AS mix_blocker
                FROM chunks WHERE run_id = ? AND t_ns >= ? GROUP BY tick) c ON c.tick = t.tick
            WHERE t.run_id = ? AND t.t_ns >= ? AND t.path != 'idle' ORDER BY t.tick""",
                         [run_id, start_ns, run_id, start_ns])
        return frame, False
    bucket_ns = max(1, (end_ns - start_ns) // NUM_BUCKETS)
    frame = query_df(db, """
        SELECT (t_ns - ?) / ? AS bucket, path, MIN(t_ns) / 1e6 AS start_ms,
               MAX(t_ns + duration_ns) / 1e6 AS end_ms, COUNT(*) AS num_ticks,
               SUM(num_prefill_tokens + num_decode_tokens) AS num_tokens,
               SUM(roofline_ns) * 1.0 / NULLIF(SUM(CASE WHEN roofline_ns IS NOT NULL THEN duration_ns END), 0)
                   AS roofline_share
        FROM ticks WHERE run_id = ? AND t_ns >= ? AND path != 'idle'
        GROUP BY bucket, path ORDER BY bucket""", [start_ns, bucket_ns, run_id, start_ns])
    return frame, True


def _links(stream_events: pd.DataFrame) -> pd.DataFrame:
    """Pair each wait with the record of the same ``seq`` (both inside the window)."""
    records = stream_events[stream_events["kind"] == "record"][["seq", "t_ms", "stream"]]
    waits = stream_events[stream_events["kind"] == "wait"]
    waits = waits.assign(wait_stream=waits["target_stream"].fillna(waits["stream"]))
    pairs = records.merge(waits[["seq", "t_ms", "wait_stream"]], on="seq", suffixes=("_record", "_wait"))
    return pd.DataFrame({"record_t_ms": pairs["t_ms_record"], "record_stream": pairs["stream"],
                         "wait_t_ms": pairs["t_ms_wait"], "wait_stream": pairs["wait_stream"]})


def _stall_rows(db: Path, run_id: int) -> list[tuple]:
    frame = query_df(db, "SELECT t_ns, kind, detail FROM (SELECT id, t_ns, kind, detail FROM events "
                         "WHERE run_id = ? AND kind IN (?, ?) ORDER BY id DESC LIMIT ?) ORDER BY id",
                     [run_id, *STALL_KINDS, MAX_STALL_EVENTS])
    return list(frame.itertuples(index=False, name=None))


def window_end_ns(db: Path, run_id: int, last_tick: dict, stall_rows: list[tuple], open_end_ms: float | None) -> int:
    """The newest moment the run has drawn: its last forward's end, or later a lever change or a
    stall event (ticks stop while the engine is blocked), or ``open_end_ms`` (now, from the
    heartbeat) while a stall is open."""
    ends = [int(last_tick["t_ns"] + last_tick["duration_ns"])]
    lever = query_one(db, "SELECT MAX(t_ns) AS t FROM lever_changes WHERE run_id = ?", [run_id]) or {}
    if lever.get("t") is not None:
        ends.append(int(lever["t"]))
    if stall_rows:
        ends.append(int(stall_rows[-1][0]))
        if open_end_ms is not None and stall_rows[-1][1] == STALL_KINDS[0]:
            ends.append(int(open_end_ms * NS_PER_MS))
    return max(ends)


def stall_frame(stall_rows: list[tuple], start_ns: int, end_ns: int) -> pd.DataFrame:
    """Blocked spells overlapping [start_ns, end_ns], in ms; one still open ends at ``end_ns``."""
    spells = [s for s in blocked_spells(stall_rows, open_end_ns=end_ns) if s.end_ns >= start_ns]
    return pd.DataFrame({"start_ms": [s.start_ns / NS_PER_MS for s in spells],
                         "end_ms": [s.end_ns / NS_PER_MS for s in spells],
                         "blocker": [s.blocker for s in spells], "is_open": [s.is_open for s in spells]},
                        columns=STALL_COLUMNS)


def timeline_window(db: Path, run_id: int, window_s: float, open_end_ms: float | None = None) -> TimelineWindow | None:
    """The last ``window_s`` seconds of the run, ready for ``timeline_figure``. The window ends at
    ``window_end_ns``: a blocked engine's stall and its lever changes stay in view after the last forward."""
    last = latest_tick(db, run_id)
    if last is None:
        return None
    stall_rows = _stall_rows(db, run_id)
    end_ns = window_end_ns(db, run_id, last, stall_rows, open_end_ms)
    start_ns = max(0, end_ns - int(window_s * 1e9))
    head = query_one(db, "SELECT COUNT(*) AS n, MIN(tick) AS first_tick FROM ticks "
                         "WHERE run_id = ? AND t_ns >= ? AND path != 'idle'", [run_id, start_ns]) or {}
    num_forwards = head.get("n") or 0
    first_tick = head.get("first_tick") if head.get("first_tick") is not None else last["tick"]
    forwards, is_bucketed = _forwards(db, run_id, start_ns, num_forwards, end_ns)
    streams = query_df(db, """
        SELECT * FROM (SELECT t_ns / 1e6 AS t_ms, kind, stream, event_name, seq, tick, target_stream,
                              gpu_elapsed_ms
                       FROM stream_events WHERE run_id = ? AND tick >= ? ORDER BY tick DESC, id DESC LIMIT ?)
        ORDER BY t_ms""", [run_id, first_tick, MAX_STREAM_EVENTS])
    if streams.empty:
        streams = pd.DataFrame(columns=["t_ms", "kind", "stream", "event_name", "seq", "tick",
                                        "target_stream", "gpu_elapsed_ms"])
    preemptions = query_df(db, "SELECT t_ns / 1e6 AS t_ms, tick, victim_request_id, blocks_freed, reason "
                               "FROM preemptions WHERE run_id = ? AND tick >= ? ORDER BY tick LIMIT ?",
                           [run_id, first_tick, MAX_MARKERS])
    levers = query_df(db, "SELECT t_ns / 1e6 AS t_ms, tick, name, old, new, status FROM lever_changes "
                          "WHERE run_id = ? AND tick >= ? ORDER BY tick LIMIT ?", [run_id, first_tick, MAX_MARKERS])
    kv_quant = query_df(db, "SELECT t_ns / 1e6 AS t_ms, tick, request_id, detail FROM events "
                            "WHERE run_id = ? AND kind = ? AND tick >= ? ORDER BY tick LIMIT ?",
                        [run_id, KV_QUANT_EVENT, first_tick, MAX_MARKERS])
    return TimelineWindow(forwards, streams, _links(streams), preemptions, levers,
                          start_ns / NS_PER_MS, end_ns / NS_PER_MS, num_forwards, is_bucketed,
                          stream_events_capped=len(streams) >= MAX_STREAM_EVENTS,
                          kv_quant_changes=kv_quant_changes(kv_quant),
                          rank_forwards=_rank_forwards(db, run_id, first_tick),
                          encoder=_encoder_events(db, run_id, first_tick),
                          stalls=stall_frame(stall_rows, start_ns, end_ns))


def kv_quant_changes(rows: pd.DataFrame) -> pd.DataFrame:
    """Event rows -> t_ms, tick, old, new, tokens_seen (the detail JSON unpacked)."""
    details = [json.loads(d) if isinstance(d, str) else {} for d in rows.get("detail", [])]
    return pd.DataFrame({"t_ms": rows.get("t_ms", []), "tick": rows.get("tick", []),
                         "old": [d.get("old") for d in details], "new": [d.get("new") for d in details],
                         "tokens_seen": [d.get("tokens_seen") for d in details]})


def kv_quant_status(db: Path, run_id: int) -> dict | None:
    """The run's latest KV quantization state change (old, new, tick), or None (full precision or none yet)."""
    row = query_one(db, "SELECT tick, detail FROM events WHERE run_id = ? AND kind = ? ORDER BY id DESC LIMIT 1",
                    [run_id, KV_QUANT_EVENT])
    if row is None:
        return None
    detail = json.loads(row["detail"]) if isinstance(row["detail"], str) else {}
    return {"tick": row["tick"], "old": detail.get("old"), "new": detail.get("new"),
            "kv_cache_dtype": detail.get("kv_cache_dtype")}


def _rank_forwards(db: Path, run_id: int, first_tick: int) -> pd.DataFrame:
    """The newest ``ep_forward`` events of the window (one per rank per forward), oldest first."""
    frame = query_df(db, """
        SELECT * FROM (
            SELECT json_extract(detail, '$.rank') AS rank, tick, t_ns / 1e6 AS start_ms,
                   json_extract(detail, '$.broadcast_ns') / 1e6 AS broadcast_ms,
                   json_extract(detail, '$.expert_ns') / 1e6 AS expert_ms,
                   json_extract(detail, '$.exchange_ns') / 1e6 AS exchange_ms,
                   json_extract(detail, '$.forward_ns') / 1e6 AS forward_ms
            FROM events WHERE run_id = ? AND kind = ? AND tick >= ? ORDER BY tick DESC, id DESC LIMIT ?)
        ORDER BY start_ms""", [run_id, EVENT_EP_FORWARD, first_tick, MAX_RANK_FORWARDS])
    return frame if not frame.empty else empty_rank_forwards()


def _encoder_events(db: Path, run_id: int, first_tick: int) -> pd.DataFrame:
    """The newest encoder runs and hits of the window at their tick's start, oldest first."""
    frame = query_df(db, """
        SELECT * FROM (
            SELECT e.tick, t.t_ns / 1e6 AS start_ms, e.kind, e.request_id,
                   json_extract(e.detail, '$.tokens') AS tokens,
                   json_extract(e.detail, '$.duration_ns') / 1e6 AS encoder_ms
            FROM events e JOIN ticks t ON t.run_id = e.run_id AND t.tick = e.tick
            WHERE e.run_id = ? AND e.kind IN (?, ?) AND e.tick >= ? ORDER BY e.tick DESC, e.id DESC LIMIT ?)
        ORDER BY start_ms""", [run_id, EVENT_ENCODER_RUN, EVENT_ENCODER_HIT, first_tick, MAX_RANK_FORWARDS])
    return frame if not frame.empty else empty_encoder_events()


def _newest(db: Path, sql: str, run_id: int) -> int:
    row = query_one(db, sql, [run_id])
    return 0 if row is None or row["v"] is None else int(row["v"])


# Every ``?``-th request id from 0 up to a bound, as index seeks: a whole-run sample costs
# its own size, not the run's (a ``request_id % step = 0`` filter would visit every row).
SAMPLED_IDS = ("SELECT request_id FROM (WITH RECURSIVE sampled(request_id) AS (SELECT 0 UNION ALL "
               "SELECT request_id + ? FROM sampled WHERE request_id + ? <= ?) SELECT request_id FROM sampled)")


def latency_percentiles(db: Path, run_id: int, is_recent: bool = True) -> pd.DataFrame:
    """TTFT, ITL and end-to-end p50 / p90 / p99 in ms (one row per metric, with ``scope``).

    TTFT and e2e come from ``requests`` rows, ITL from the gap between
    consecutive ``tokens`` of one request. Live (``is_recent``): the newest
    ``RECENT_REQUESTS`` requests and ``ITL_RECENT_TOKENS`` tokens, both
    primary-key range scans. Whole run: an even sample of request ids (every
    k-th) of at most ``WHOLE_RUN_REQUESTS`` requests for TTFT / e2e, and of about
    ``ITL_SAMPLE_TOKENS`` tokens for ITL, read by index seeks, so the cost stays
    flat however long the run grows.
    """
    max_request = _newest(db, "SELECT MAX(request_id) AS v FROM requests WHERE run_id = ?", run_id)
    if is_recent:
        # request ids start at 0: the bound may go negative, never clamp it to 0
        request_filter, request_params = "AND request_id > ?", [max_request - RECENT_REQUESTS]
        min_token = max(0, _newest(db, "SELECT id AS v FROM tokens WHERE +run_id = ? ORDER BY id DESC LIMIT 1",
                                   run_id) - ITL_RECENT_TOKENS)
        # "+run_id" keeps SQLite on the primary-key range instead of the run's whole index.
        itl_filter, itl_params = "AND id > ?", [min_token]
        # Say the scope that applies: a young run has fewer requests than the cap.
        num_requests = min(RECENT_REQUESTS, max_request + 1)
        # a noun phrase that reads after "latency over" (never "over the all 605 requests")
        scope = (f"the newest {RECENT_REQUESTS:,} requests / {ITL_RECENT_TOKENS:,} tokens"
                 if num_requests == RECENT_REQUESTS else f"all {plural(num_requests, 'request')} so far")
    else:
        step = max(1, -(-(max_request + 1) // WHOLE_RUN_REQUESTS))
        request_filter, request_params = f"AND request_id IN ({SAMPLED_IDS})", [step, step, max_request]
        itl_step = max(1, -(-int(run_totals_of(db, run_id)["num_tokens"] or 0) // ITL_SAMPLE_TOKENS))
        itl_filter, itl_params = f"AND request_id IN ({SAMPLED_IDS})", [itl_step, itl_step, max_request]
        parts = ([f"TTFT / e2e over every {ordinal(step)} request"] if step > 1 else []) + \
            ([f"ITL over every {ordinal(itl_step)} request"] if itl_step > 1 else [])
        scope = "the whole run" + (f" ({', '.join(parts)})" if parts else "")
    ttft = query_one(db, percentile_sql("SELECT (first_token_ns - arrival_ns) / 1e6 AS v FROM requests "
                                        f"WHERE run_id = ? {request_filter} AND first_token_ns IS NOT NULL"),
                     [run_id, *request_params])
    e2e = query_one(db, percentile_sql("SELECT (finished_ns - arrival_ns) / 1e6 AS v FROM requests "
                                       f"WHERE run_id = ? {request_filter} AND finished_ns IS NOT NULL "
                                       "AND status = 'finished'"), [run_id, *request_params])
    itl = query_one(db, percentile_sql(
        "SELECT (t_ns - LAG(t_ns) OVER (PARTITION BY request_id ORDER BY \"index\")) / 1e6 AS v "
        f"FROM tokens WHERE {'+' if is_recent else ''}run_id = ? {itl_filter}"), [run_id, *itl_params])
    rows = []
    for metric, row in (("TTFT", ttft), ("ITL", itl), ("e2e", e2e)):
        row = row or {}
        rows.append({"metric": metric, "p50_ms": row.get("p50"), "p90_ms": row.get("p90"),
                     "p99_ms": row.get("p99"), "count": row.get("count") or 0, "scope": scope})
    return pd.DataFrame(rows)
