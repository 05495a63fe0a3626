"""A run's whole-run totals: the writer's running sums on the runs row, or the same numbers from the rows.

Stores written before the totals existed (an old bundle, say) have no such columns or NULLs;
they get ``run_totals.totals_sql`` instead: correct, only slower on a long run.
"""
from __future__ import annotations

from pathlib import Path

from dashboard.queries.db import query_one
from telemetry import run_totals


def run_totals_of(db: Path, run_id: int) -> dict[str, int | None]:
    """Every column of ``telemetry.run_totals.TOTALS`` (tick, token, chunk, preemption and request totals)."""
    row = query_one(db, "SELECT * FROM runs WHERE run_id = ?", [run_id]) or {}
    stored = run_totals.from_row(row)
    if stored is not None:
        return stored
    sql, num_binds = run_totals.totals_sql()
    return query_one(db, sql, [run_id] * num_binds) or run_totals.zeros()
