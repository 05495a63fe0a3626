"""Queries behind the speculation views: acceptance over time by kind, drafts per tick, dropped drafts.

The engine writes one ``spec_step`` row (``events`` table) per speculative step
with its kind, drafted / accepted / emitted counts, and one ``drafts_dropped``
row at the fused (mixed) tick that threw pending drafts away. Everything is
aggregated in SQL; the Live page reads the newest ``RECENT_STEPS`` steps, an
id-range whose cost does not grow with the run.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from dashboard.queries.db import query_df, query_one

SPEC_STEP = "spec_step"
DRAFTS_DROPPED = "drafts_dropped"
RECENT_STEPS = 20_000
NUM_BUCKETS = 40
MAX_ROWS = 5_000
_STEP_COLUMNS = """json_extract(detail, '$.kind') AS spec_kind,
    json_extract(detail, '$.num_drafted') AS num_drafted,
    json_extract(detail, '$.num_accepted') AS num_accepted,
    json_extract(detail, '$.num_emitted') AS num_emitted"""
_STEPS_WITH_DRAFTS = "run_id = ? AND kind = ? AND id > ? AND json_extract(detail, '$.num_drafted') > 0"


def has_speculation(db: Path, run_id: int) -> bool:
    """Any speculative step or dropped draft in the run (one (run_id, kind) index probe per kind)."""
    return any(query_one(db, "SELECT 1 AS v FROM events WHERE run_id = ? AND kind = ? LIMIT 1", [run_id, kind])
               for kind in (SPEC_STEP, DRAFTS_DROPPED))


def _recent_min_id(db: Path, run_id: int, kind: str, newest: int) -> int:
    row = query_one(db, "SELECT MAX(id) AS hi FROM events WHERE run_id = ? AND kind = ?", [run_id, kind]) or {}
    return -1 if row.get("hi") is None else int(row["hi"]) - newest


def acceptance_over_time(db: Path, run_id: int, num_buckets: int = NUM_BUCKETS,
                         newest: int = RECENT_STEPS) -> pd.DataFrame:
    """Columns ``bucket_s`` (bucket start, s since run start), ``bucket_width_s``, ``spec_kind``,
    ``num_steps``, ``num_drafted``, ``num_accepted``, ``acceptance`` (accepted / drafted, 0..1);
    one row per (bucket, kind) with drafts, oldest first."""
    columns = ["bucket_s", "bucket_width_s", "spec_kind", "num_steps", "num_drafted", "num_accepted", "acceptance"]
    min_id = _recent_min_id(db, run_id, SPEC_STEP, newest)
    span = query_one(db, f"SELECT MIN(t_ns) AS lo, MAX(t_ns) AS hi FROM events WHERE {_STEPS_WITH_DRAFTS}",
                     [run_id, SPEC_STEP, min_id]) or {}
    if span.get("lo") is None:
        return pd.DataFrame(columns=columns)
    lo = int(span["lo"])
    width_ns = max(1, -(-(int(span["hi"]) - lo + 1) // num_buckets))
    frame = query_df(db, f"""
        SELECT (t_ns - ?) / ? AS bucket, json_extract(detail, '$.kind') AS spec_kind, COUNT(*) AS num_steps,
               SUM(json_extract(detail, '$.num_drafted')) AS num_drafted,
               SUM(json_extract(detail, '$.num_accepted')) AS num_accepted
        FROM events WHERE {_STEPS_WITH_DRAFTS} GROUP BY bucket, spec_kind ORDER BY bucket, spec_kind""",
                     [lo, width_ns, run_id, SPEC_STEP, min_id])
    frame["bucket_s"] = (lo + frame["bucket"] * width_ns) / 1e9
    frame["bucket_width_s"] = width_ns / 1e9
    frame["acceptance"] = frame["num_accepted"] / frame["num_drafted"]
    return frame[columns]


def totals_by_kind(db: Path, run_id: int, newest: int = RECENT_STEPS) -> pd.DataFrame:
    """Per kind over the newest steps: ``num_steps`` (with drafts), ``num_drafted``, ``num_accepted``,
    ``num_emitted``, ``acceptance`` and ``tokens_per_step`` (emitted per verify step)."""
    frame = query_df(db, f"""
        SELECT spec_kind, COUNT(*) AS num_steps, SUM(num_drafted) AS num_drafted,
               SUM(num_accepted) AS num_accepted, SUM(num_emitted) AS num_emitted
        FROM (SELECT {_STEP_COLUMNS} FROM events WHERE run_id = ? AND kind = ? AND id > ?)
        WHERE num_drafted > 0 GROUP BY spec_kind ORDER BY spec_kind""",
                     [run_id, SPEC_STEP, _recent_min_id(db, run_id, SPEC_STEP, newest)])
    frame["acceptance"] = frame["num_accepted"] / frame["num_drafted"]
    frame["tokens_per_step"] = frame["num_emitted"] / frame["num_steps"]
    return frame


def first_tick_since(db: Path, run_id: int, start_ns: int) -> int:
    """The first tick at or after ``start_ns`` (window bounds become a (run_id, tick) index range)."""
    row = query_one(db, "SELECT MIN(tick) AS v FROM ticks WHERE run_id = ? AND t_ns >= ?", [run_id, start_ns]) or {}
    return int(row["v"]) if row.get("v") is not None else 1 << 62


def steps_since(db: Path, run_id: int, first_tick: int, limit: int = MAX_ROWS) -> pd.DataFrame:
    """Speculative steps with drafts from ``first_tick`` on: ``t_ms``, ``tick``, ``request_id``,
    ``spec_kind``, ``num_drafted``, ``num_accepted``, ``num_emitted`` (the newest ``limit``)."""
    return query_df(db, f"""
        SELECT * FROM (SELECT t_ns / 1e6 AS t_ms, tick, request_id, {_STEP_COLUMNS}
                       FROM events WHERE run_id = ? AND tick >= ? AND +kind = ?
                       AND json_extract(detail, '$.num_drafted') > 0 ORDER BY tick DESC LIMIT ?)
        ORDER BY t_ms""", [run_id, first_tick, SPEC_STEP, limit])


def drops_since(db: Path, run_id: int, first_tick: int, limit: int = MAX_ROWS) -> pd.DataFrame:
    """Drafts-dropped events from ``first_tick`` on, beside the fused tick that caused each: ``t_ms``,
    ``tick``, ``num_dropped``, and that tick's ``path``, ``num_prefill_tokens``, ``num_decode_tokens``."""
    return query_df(db, """
        SELECT * FROM (SELECT e.t_ns / 1e6 AS t_ms, e.tick, json_extract(e.detail, '$.num_dropped') AS num_dropped,
                              t.path, t.num_prefill_tokens, t.num_decode_tokens
                       FROM events e LEFT JOIN ticks t ON t.run_id = e.run_id AND t.tick = e.tick
                       WHERE e.run_id = ? AND e.tick >= ? AND +e.kind = ? ORDER BY e.tick DESC LIMIT ?)
        ORDER BY t_ms""", [run_id, first_tick, DRAFTS_DROPPED, limit])
