"""Queries behind the prefix-cache views: hit ratio over time, miss reasons, snapshot event counts.

Hit ratio = prefix-hit tokens / prompt tokens of the requests admitted in a
time bucket (by arrival, seconds since run start); rejected requests never
reached the cache and are left out. Everything is aggregated in SQL.

Each view takes a ``PrefixScope``: the whole run, or (the Live page) the newest
``RECENT_REQUESTS`` requests and the events since the oldest of them arrived, a
primary-key / tick-index range whose cost does not grow with the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dashboard.queries.db import placeholders, query_df, query_one

NUM_BUCKETS = 60
RECENT_REQUESTS = 2_000        # the Live strip's scope, as the Live latency table's
SNAPSHOT_KINDS = ("prefix_hit", "prefix_ssm_cut", "snapshot_taken", "snapshot_restored", "snapshot_evicted")
_ADMITTED = "run_id = ? AND request_id > ? AND admitted_ns IS NOT NULL AND prompt_len > 0"


@dataclass(frozen=True)
class PrefixScope:
    min_request_id: int = -1       # requests with a larger id (ids start at 0)
    min_tick: int = 0              # events at this tick or later
    num_requests: int | None = None    # the newest this many requests; None = the whole run

    @property
    def label(self) -> str:
        return "run" if self.num_requests is None else f"newest {self.num_requests:,} requests"


WHOLE_RUN = PrefixScope()


def recent_scope(db: Path, run_id: int, newest: int = RECENT_REQUESTS) -> PrefixScope:
    """The newest ``newest`` requests (the whole run while it has no more than that)."""
    top = query_one(db, "SELECT MAX(request_id) AS v FROM requests WHERE run_id = ?", [run_id]) or {}
    if top.get("v") is None or top["v"] < newest:
        return WHOLE_RUN
    min_request_id = int(top["v"]) - newest
    first = query_one(db, "SELECT MIN(arrival_tick) AS v FROM requests WHERE run_id = ? AND request_id > ?",
                      [run_id, min_request_id]) or {}
    return PrefixScope(min_request_id, int(first.get("v") or 0), newest)


def hit_ratio_over_time(db: Path, run_id: int, num_buckets: int = NUM_BUCKETS,
                        scope: PrefixScope = WHOLE_RUN) -> pd.DataFrame:
    """Columns ``bucket_s`` (bucket start), ``bucket_width_s``, ``num_requests``, ``hit_tokens``,
    ``prompt_tokens``, ``hit_ratio`` (0..1); one row per non-empty bucket, oldest first."""
    span = query_one(db, f"SELECT MIN(arrival_ns) AS lo, MAX(arrival_ns) AS hi FROM requests WHERE {_ADMITTED}",
                     [run_id, scope.min_request_id]) or {}
    columns = ["bucket_s", "bucket_width_s", "num_requests", "hit_tokens", "prompt_tokens", "hit_ratio"]
    if span.get("lo") is None:
        return pd.DataFrame(columns=columns)
    lo = int(span["lo"])
    width_ns = max(1, -(-(int(span["hi"]) - lo + 1) // num_buckets))
    frame = query_df(db, f"""
        SELECT (arrival_ns - ?) / ? AS bucket, COUNT(*) AS num_requests,
               SUM(prefix_hit_tokens) AS hit_tokens, SUM(prompt_len) AS prompt_tokens
        FROM requests WHERE {_ADMITTED} GROUP BY bucket ORDER BY bucket""", [lo, width_ns, run_id,
                                                                             scope.min_request_id])
    frame["bucket_s"] = (lo + frame["bucket"] * width_ns) / 1e9
    frame["bucket_width_s"] = width_ns / 1e9
    frame["hit_ratio"] = frame["hit_tokens"] / frame["prompt_tokens"]
    return frame[columns]


def totals(db: Path, run_id: int, scope: PrefixScope = WHOLE_RUN) -> dict:
    """Hit tokens, prompt tokens, requests with any hit, and admitted requests in the scope."""
    row = query_one(db, "SELECT COUNT(*) AS num_requests, COALESCE(SUM(prefix_hit_tokens > 0), 0) AS num_hits, "
                        "COALESCE(SUM(prefix_hit_tokens), 0) AS hit_tokens, "
                        f"COALESCE(SUM(prompt_len), 0) AS prompt_tokens FROM requests WHERE {_ADMITTED}",
                    [run_id, scope.min_request_id]) or {}
    prompt = row.get("prompt_tokens") or 0
    return {**row, "hit_ratio": (row.get("hit_tokens") or 0) / prompt if prompt else None}


def miss_reasons(db: Path, run_id: int, scope: PrefixScope = WHOLE_RUN) -> pd.DataFrame:
    """Why hits stopped short, grouped by the reason's kind (the text before `` at token``)."""
    return query_df(db, f"""
        SELECT CASE WHEN instr(prefix_miss_reason, ' at token') > 0
                    THEN substr(prefix_miss_reason, 1, instr(prefix_miss_reason, ' at token') - 1)
                    ELSE prefix_miss_reason END AS reason,
               COUNT(*) AS num_requests, MAX(request_id) AS newest_request,
               MAX(prefix_miss_reason) AS example
        FROM requests WHERE {_ADMITTED} AND prefix_miss_reason IS NOT NULL AND prefix_miss_reason != ''
        GROUP BY reason ORDER BY num_requests DESC""", [run_id, scope.min_request_id])


def snapshot_counts(db: Path, run_id: int, scope: PrefixScope = WHOLE_RUN) -> dict[str, int]:
    """Count of each prefix / snapshot event kind in the ``events`` table (0 when absent).

    ``+kind`` keeps SQLite on the (run_id, tick) range of the scope rather than every event of those kinds.
    """
    frame = query_df(db, f"SELECT kind, COUNT(*) AS n FROM events WHERE run_id = ? AND tick >= ? "
                         f"AND +kind IN ({placeholders(SNAPSHOT_KINDS)}) GROUP BY kind",
                     [run_id, scope.min_tick, *SNAPSHOT_KINDS])
    found = {str(k): int(n) for k, n in zip(frame["kind"], frame["n"])} if len(frame) else {}
    return {kind: found.get(kind, 0) for kind in SNAPSHOT_KINDS}
