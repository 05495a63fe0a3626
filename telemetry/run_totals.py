"""Whole-run totals kept on the ``runs`` row, so a whole-run view costs a primary-key read.

The writer adds each committed batch's deltas to these columns in the batch's own
transaction (``batch_deltas``), so they always agree with the rows committed so
far. Without them, the Runs page re-aggregated every tick and chunk of a run on
each cold render, and its time grew with the run (0.14 -> 0.65 s over a 30-minute
soak). A column is NULL on a run written before it existed: readers then fall back
to ``totals_sql``, the same numbers computed from the rows. A pruned snapshot
(bundle with a time window) recomputes them with ``recompute``.

Plain Python + sqlite3 only: no torch, no engine imports.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from telemetry import events as ev

# column -> (table, SQL aggregate over that table's rows of one run). Counts include idle ticks.
TOTALS: dict[str, tuple[str, str]] = {
    "num_ticks": ("ticks", "COUNT(*)"),
    "num_prefill_tokens": ("ticks", "COALESCE(SUM(num_prefill_tokens), 0)"),
    "num_decode_tokens": ("ticks", "COALESCE(SUM(num_decode_tokens), 0)"),
    "num_mixed_ticks": ("ticks", "COALESCE(SUM(path = 'mixed'), 0)"),
    "last_tick_end_ns": ("ticks", "MAX(t_ns + duration_ns)"),
    "num_chunks": ("chunks", "COUNT(*)"),
    "num_mixed_chunks": ("chunks", "COALESCE(SUM(path = 'mixed'), 0)"),
    "num_preemptions": ("preemptions", "COUNT(*)"),
    "num_tokens": ("tokens", "COUNT(*)"),
    # requests rows are upserted: the writer adds new state minus the stored state (request_deltas)
    "num_requests": ("requests", "COUNT(*)"),
    # one total per end state, and the requests not ended yet (REQUEST_STATES says which statuses)
    "num_finished_requests": ("requests", "COALESCE(SUM(status = 'finished'), 0)"),
    "num_error_requests": ("requests", "COALESCE(SUM(status = 'error'), 0)"),
    "num_preempted_requests": ("requests", "COALESCE(SUM(status = 'preempted'), 0)"),
    "num_rejected_requests": ("requests", "COALESCE(SUM(status = 'rejected'), 0)"),
    "num_cancelled_requests": ("requests", "COALESCE(SUM(status = 'cancelled'), 0)"),
    "num_running_requests": ("requests", "COALESCE(SUM(status IN ('waiting', 'prefilling', 'decoding')), 0)"),
    "num_prompt_tokens": ("requests", "COALESCE(SUM(prompt_len), 0)"),
    "num_prefix_hit_tokens": ("requests", "COALESCE(SUM(prefix_hit_tokens), 0)"),
}
# The statuses each request-state total counts (the SQL above says the same for totals_sql).
REQUEST_STATES: dict[str, tuple[str, ...]] = {
    "num_finished_requests": (ev.REQ_FINISHED,),
    "num_error_requests": (ev.REQ_ERROR,),
    "num_preempted_requests": (ev.REQ_PREEMPTED,),
    "num_rejected_requests": (ev.REQ_REJECTED,),
    "num_cancelled_requests": (ev.REQ_CANCELLED,),
    "num_running_requests": ev.IN_FLIGHT_STATUSES,
}
REQUEST_COLUMNS = ("request_id", "status", "prompt_len", "prefix_hit_tokens")   # what request_deltas reads
REQUEST_TOTALS = tuple(c for c, (table, _) in TOTALS.items() if table == "requests")
COLUMNS: tuple[str, ...] = tuple(TOTALS)
_ADDED = tuple(c for c in COLUMNS if c != "last_tick_end_ns")   # summed; last_tick_end_ns takes the max


def request_deltas(new: Iterable[tuple], stored: Iterable[tuple]) -> dict[str, int]:
    """Request totals a batch adds: its final request states minus the rows they replace.

    Both are ``REQUEST_COLUMNS`` tuples; ``new`` holds one state per request id (the batch's
    last), ``stored`` the rows already in the table for those ids.
    """
    deltas = dict.fromkeys(REQUEST_TOTALS, 0)
    for sign, rows in ((1, new), (-1, stored)):
        for _, status, prompt_len, hit in rows:
            deltas["num_requests"] += sign
            for column, statuses in REQUEST_STATES.items():
                deltas[column] += sign * (status in statuses)
            deltas["num_prompt_tokens"] += sign * (prompt_len or 0)
            deltas["num_prefix_hit_tokens"] += sign * (hit or 0)
    return deltas


_STORED_COLUMNS = ", ".join(REQUEST_COLUMNS)
_MAX_IDS = 500          # bound variables per lookup, well under SQLite's limit


def upsert_deltas(conn: sqlite3.Connection, run_id: int, columns: tuple[str, ...], rows: list[tuple]
                  ) -> dict[str, int]:
    """``request_deltas`` for upserting ``rows`` (insert tuples in ``columns`` order, one per request id).

    Reads the stored rows they will replace, so call it in the batch's transaction before the upsert.
    """
    positions = [columns.index(c) for c in REQUEST_COLUMNS]
    new = [tuple(row[i] for i in positions) for row in rows]
    ids = [state[0] for state in new]
    stored: list[tuple] = []
    for start in range(0, len(ids), _MAX_IDS):
        part = ids[start:start + _MAX_IDS]
        marks = ", ".join("?" * len(part))
        stored += conn.execute(f"SELECT {_STORED_COLUMNS} FROM requests WHERE run_id = ? "
                               f"AND request_id IN ({marks})", [run_id, *part]).fetchall()
    return request_deltas(new, stored)


def batch_deltas(by_class: Mapping[type, list[Any]], requests: Mapping[str, int] | None = None
                 ) -> dict[str, int | None]:
    """What one batch adds: counts and sums per total, and the batch's latest tick end (None if no tick).

    ``requests``: the batch's ``request_deltas`` (zeros when it has no request rows).
    """
    ticks = by_class.get(ev.Tick, ())
    chunks = by_class.get(ev.ChunkDecision, ())
    return {
        **(requests or dict.fromkeys(REQUEST_TOTALS, 0)),
        "num_ticks": len(ticks),
        "num_prefill_tokens": sum(t.num_prefill_tokens for t in ticks),
        "num_decode_tokens": sum(t.num_decode_tokens for t in ticks),
        "num_mixed_ticks": sum(t.path == ev.PATH_MIXED for t in ticks),
        "last_tick_end_ns": max((t.t_ns + t.duration_ns for t in ticks), default=None),
        "num_chunks": len(chunks),
        "num_mixed_chunks": sum(c.path == ev.PATH_MIXED for c in chunks),
        "num_preemptions": len(by_class.get(ev.Preemption, ())),
        "num_tokens": len(by_class.get(ev.TokenEvent, ())),
    }


# The SET clause adding a batch's deltas (bind ``update_params``). ``NULL + n`` stays NULL, so a
# run created before these columns existed stays "unknown" rather than becoming a partial count.
UPDATE_SET = ", ".join([f"{c} = {c} + ?" for c in _ADDED] + [
    "last_tick_end_ns = CASE WHEN ? IS NULL THEN last_tick_end_ns ELSE MAX(COALESCE(last_tick_end_ns, 0), ?) END"])


def update_params(deltas: Mapping[str, int | None]) -> list[Any]:
    """Values for ``UPDATE_SET``, in its order."""
    end = deltas["last_tick_end_ns"]
    return [*(deltas[c] for c in _ADDED), end, end]


def zeros() -> dict[str, int | None]:
    """A new run's starting totals (last_tick_end_ns unknown until its first tick)."""
    return {c: (None if c == "last_tick_end_ns" else 0) for c in COLUMNS}


def totals_sql() -> tuple[str, int]:
    """One SELECT computing every total from the rows; bind run_id ``n`` times (the returned count)."""
    tables = dict.fromkeys(table for table, _ in TOTALS.values())
    parts = []
    for table in tables:
        aggregates = ", ".join(f"{agg} AS {col}" for col, (t, agg) in TOTALS.items() if t == table)
        parts.append(f"(SELECT {aggregates} FROM [{table}] WHERE run_id = ?) AS [{table}]")
    columns = ", ".join(f"[{table}].{col}" for col, (table, _) in TOTALS.items())
    return f"SELECT {columns} FROM {', '.join(parts)}", len(tables)


def from_row(row: Mapping[str, Any]) -> dict[str, int | None] | None:
    """The totals stored on a runs row, or None when any is missing (an older store: use totals_sql)."""
    values = {c: row.get(c) for c in COLUMNS}
    if any(values[c] is None for c in _ADDED):
        return None
    return values


def recompute(conn: sqlite3.Connection, run_ids: Iterable[int]) -> None:
    """Set the stored totals of ``run_ids`` from their rows (after a snapshot was pruned)."""
    existing = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    for column in COLUMNS:          # a snapshot of a store written before the totals existed
        if column not in existing:
            conn.execute(f"ALTER TABLE runs ADD COLUMN [{column}] INTEGER")
    sql, num_binds = totals_sql()
    names = ", ".join(f"{c} = ?" for c in COLUMNS)
    for run_id in run_ids:
        values = conn.execute(sql, [run_id] * num_binds).fetchone()
        conn.execute(f"UPDATE runs SET {names} WHERE run_id = ?", [*values, run_id])
