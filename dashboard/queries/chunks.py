"""Queries behind the Chunks page: the filtered decision table, length histogram, mix share.

Filters become a parameterized WHERE clause (values bound, never formatted
in); the histogram and the share over time are GROUP BYs, so only bins come
back to Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dashboard.queries.db import placeholders, query_df, query_one
from dashboard.queries.ids import IdSelection
from dashboard.queries.totals import run_totals_of
from telemetry import events as ev

NO_BLOCKER = "(none: mixing allowed)"
PATHS = (ev.PATH_MIXED, ev.PATH_PREFILL)
CAP_RULES = (ev.CAP_REMAINING, ev.CAP_MAX_PREFILL, ev.CAP_SLICE_BUDGET, ev.CAP_WHOLE_PROMPT,
             ev.CAP_SSM_TAIL, ev.CAP_BLOCK_ALIGN, ev.CAP_TAIL_SPLIT, ev.CAP_ENCODER_BUDGET, ev.CAP_IMAGE_WHOLE)
BLOCKERS = (NO_BLOCKER, ev.BLOCK_BISECT, ev.BLOCK_NO_DECODES, ev.BLOCK_EXPERT_PARALLEL, ev.BLOCK_SPECULATION)
# What a user opens Chunks for first (the decision: path, can_mix, its blocker, the cap rule and the
# chunk) so it fits a 1280 px window; the lever values, outcome and image columns after (issue 29, item 5).
TABLE_COLUMNS = ("tick", "request_id", "path", "can_mix", "mix_blocker", "cap_rule", "offset", "length",
                 "prompt_len", "is_last", "duration_ns", "decode_width", "max_prefill_tokens", "slice_budget",
                 "slice_budget_ignored", "ssm_tail_boundary", "outcome", "num_preempted", "kv_quant_state",
                 "image_spans", "encoder_ns")
NUM_HIST_BINS = 40
NEWEST_SCOPE = 10_000          # default view: the newest decisions (minutes of a busy run), so cost stays flat
NUM_SHARE_BUCKETS = 60


@dataclass(frozen=True)
class ChunkFilter:
    requests: IdSelection | None = None  # None = any request (ids and ranges: dashboard/queries/ids.py)
    paths: tuple[str, ...] = ()          # empty = any
    cap_rules: tuple[str, ...] = ()
    blockers: tuple[str, ...] = ()       # may include NO_BLOCKER
    min_tick: int | None = None          # scope: only decisions at tick >= min_tick (None = whole run)

    def where(self, run_id: int) -> tuple[str, list]:
        clauses, params = ["run_id = ?"], [run_id]
        if self.min_tick is not None:       # a range of the (run_id, tick) index
            clauses.append("tick >= ?")
            params.append(self.min_tick)
        if self.requests is not None:
            where, values = self.requests.where("request_id")
            clauses.append(where)
            params += values
        if self.paths:
            clauses.append(f"path IN ({placeholders(self.paths)})")
            params += list(self.paths)
        if self.cap_rules:
            clauses.append(f"cap_rule IN ({placeholders(self.cap_rules)})")
            params += list(self.cap_rules)
        if self.blockers:
            named = [b for b in self.blockers if b != NO_BLOCKER]
            parts = [f"mix_blocker IN ({placeholders(named)})"] if named else []
            if NO_BLOCKER in self.blockers:
                parts.append("mix_blocker IS NULL")
            clauses.append("(" + " OR ".join(parts) + ")")
            params += named
        return " AND ".join(clauses), params


def scope_start(db: Path, run_id: int, newest: int = NEWEST_SCOPE) -> tuple[int | None, int]:
    """(first tick of the run's newest ``newest`` chunks, or None if the run has fewer; run total)."""
    num_total = int(run_totals_of(db, run_id)["num_chunks"] or 0)   # the writer's count: no pass over the run
    if num_total <= newest:
        return None, num_total
    row = query_one(db, "SELECT tick FROM chunks WHERE run_id = ? ORDER BY tick DESC LIMIT 1 OFFSET ?",
                    [run_id, newest - 1])
    return (int(row["tick"]) if row else None), num_total


def chunk_count(db: Path, run_id: int, flt: ChunkFilter) -> int:
    where, params = flt.where(run_id)
    row = query_one(db, f"SELECT COUNT(*) AS n FROM chunks WHERE {where}", params)
    return int(row["n"]) if row else 0


def chunk_table(db: Path, run_id: int, flt: ChunkFilter, limit: int = 500) -> pd.DataFrame:
    """The newest ``limit`` matching decisions, newest first."""
    where, params = flt.where(run_id)
    # A store written before a column was added (an old bundle) lacks it: show what it has.
    present = set(query_df(db, "SELECT name FROM pragma_table_info(?)", ["chunks"])["name"])
    cols = ", ".join(f'"{c}"' for c in TABLE_COLUMNS if c in present)
    frame = query_df(db, f"SELECT {cols} FROM chunks WHERE {where} ORDER BY tick DESC, id DESC LIMIT ?",
                     params + [int(limit)])
    for col in ("is_last", "can_mix"):
        if col in frame:
            frame[col] = frame[col].astype("boolean")
    return frame


def length_histogram(db: Path, run_id: int, flt: ChunkFilter) -> pd.DataFrame:
    """Columns ``bin_start``, ``bin_width``, ``path``, ``count``."""
    where, params = flt.where(run_id)
    top = query_one(db, f"SELECT MAX(length) AS m FROM chunks WHERE {where}", params)
    max_len = (top or {}).get("m") or 0
    width = max(1, -(-int(max_len + 1) // NUM_HIST_BINS))
    return query_df(db, f"SELECT (length / ?) * ? AS bin_start, ? AS bin_width, path, COUNT(*) AS count "
                        f"FROM chunks WHERE {where} GROUP BY bin_start, path ORDER BY bin_start",
                    [width, width, width] + params)


def mix_share(db: Path, run_id: int, flt: ChunkFilter) -> pd.DataFrame:
    """Mixed vs plain chunks per time bucket. Columns ``bucket_s``, ``num_mixed``, ``num_plain``."""
    where, params = flt.where(run_id)
    span = query_one(db, f"SELECT MIN(t_ns) AS lo, MAX(t_ns) AS hi FROM chunks WHERE {where}", params) or {}
    if span.get("lo") is None:
        return pd.DataFrame(columns=["bucket_s", "num_mixed", "num_plain"])
    bucket_ns = max(1, (span["hi"] - span["lo"]) // NUM_SHARE_BUCKETS + 1)
    frame = query_df(db, f"SELECT t_ns / ? AS bucket, SUM(path = 'mixed') AS num_mixed, "
                         f"SUM(path != 'mixed') AS num_plain FROM chunks WHERE {where} "
                         f"GROUP BY bucket ORDER BY bucket", [bucket_ns] + params)
    frame.insert(0, "bucket_s", frame.pop("bucket") * bucket_ns / 1e9)
    return frame
