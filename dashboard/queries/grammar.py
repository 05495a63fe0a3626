"""Queries behind the grammar strip of the Requests page: which requests hold a grammar and whether
their output validated, the mask's share of tick time, and preemptions that skipped grammar holders.

A store written before grammars existed has none of these columns: every query then answers
"no grammar data" (None / an empty frame) instead of failing the page.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from dashboard.queries.db import DataUnavailable, placeholders, query_df, query_one

RECENT_TICKS = 5_000     # the mask share is over the newest ticks (a tick-index range, cheap on any run)


def _absent(exc: DataUnavailable) -> bool:
    return "no such column" in exc.message


def marks(db: Path, run_id: int, request_ids: list[int]) -> pd.DataFrame:
    """request_id, grammar_kind, grammar_valid and grammar_approximations (when the store has that
    column) for the listed requests (empty without grammar columns)."""
    empty = pd.DataFrame(columns=["request_id", "grammar_kind", "grammar_valid"])
    if not request_ids:
        return empty
    params = [run_id, *request_ids]
    try:
        return query_df(db, "SELECT request_id, grammar_kind, grammar_valid, grammar_approximations FROM requests "
                            f"WHERE run_id = ? AND request_id IN ({placeholders(request_ids)})", params)
    except DataUnavailable as exc:
        if not _absent(exc):
            raise
    try:   # a store written before lenient compiles
        return query_df(db, "SELECT request_id, grammar_kind, grammar_valid FROM requests "
                            f"WHERE run_id = ? AND request_id IN ({placeholders(request_ids)})", params)
    except DataUnavailable as exc:
        if _absent(exc):
            return empty
        raise


def summary(db: Path, run_id: int) -> dict | None:
    """Counts for the strip, or None when the store predates grammars."""
    try:
        requests = query_one(db, "SELECT count(*) AS num, sum(grammar_valid = 1) AS num_valid, "
                                 "sum(grammar_valid = 0) AS num_invalid, sum(finish_reason = 'stop') AS num_stop "
                                 "FROM requests WHERE run_id = ? AND grammar_kind IS NOT NULL", [run_id])
        newest = query_one(db, "SELECT max(tick) AS tick FROM ticks WHERE run_id = ?", [run_id])
        since = (newest["tick"] or 0) - RECENT_TICKS
        ticks = query_one(db, "SELECT count(*) AS num_ticks, sum(num_constrained_rows > 0) AS num_masked_ticks, "
                              "sum(num_constrained_rows) AS num_rows, sum(grammar_mask_ns) AS mask_ns, "
                              "sum(duration_ns) AS tick_ns FROM ticks WHERE run_id = ? AND tick > ?",
                          [run_id, since])
        skips = query_one(db, "SELECT count(*) AS num_preemptions, sum(num_grammar_skipped > 0) AS num_with_skips, "
                              "sum(num_grammar_skipped) AS num_skipped FROM preemptions WHERE run_id = ?", [run_id])
    except DataUnavailable as exc:
        if _absent(exc):
            return None
        raise
    by_kind = query_df(db, "SELECT grammar_kind AS kind, count(*) AS requests, sum(grammar_valid = 1) AS validated "
                           "FROM requests WHERE run_id = ? AND grammar_kind IS NOT NULL GROUP BY grammar_kind "
                           "ORDER BY grammar_kind", [run_id])
    out = {k: int(v or 0) for part in (requests, ticks, skips) for k, v in part.items()}
    out["mask_share"] = out["mask_ns"] / out["tick_ns"] if out["tick_ns"] else None
    out["by_kind"] = by_kind
    return out
