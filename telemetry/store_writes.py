"""The writer thread's transactions: open the store, commit one batch, insert and finish the run row.

Kept apart from ``telemetry.writer`` (the thread, its queue and back-pressure) so each reads
as one concept; only the writer thread calls these, on its own connection.
"""
from __future__ import annotations

import os
import socket
import sqlite3
import time
from typing import Any

import sqlite_utils

from telemetry import run_totals, schema
from telemetry.events import RunStarted

# One statement per batch: the run row's counters and its whole-run totals.
_BATCH_UPDATE = ("UPDATE runs SET num_events = num_events + ?, writer_wait_ns = ?, num_dropped = ?, "
                 f"{run_totals.UPDATE_SET} WHERE run_id = ?")


def open_store(db_path: str, *, busy_timeout_ms: int, wal_limit_bytes: int) -> sqlite_utils.Database:
    """The write connection, configured, with the schema in place (closed again if that fails)."""
    conn = sqlite3.connect(db_path, check_same_thread=False)
    db = sqlite_utils.Database(conn)
    try:
        schema.configure_connection(db, busy_timeout_ms=busy_timeout_ms)
        # After a WAL reset SQLite truncates the file back to this size.
        db.execute(f"PRAGMA journal_size_limit={int(wal_limit_bytes)}")
        schema.ensure_schema(db)
    except BaseException:
        conn.close()
        raise
    return db


def commit_events(db: sqlite_utils.Database, run_id: int, events: list[Any], *,
                  writer_wait_ns: int, num_dropped: int) -> None:
    """One transaction: every event's row, and the run row's counters and totals to match."""
    by_class: dict[type, list[Any]] = {}
    for event in events:
        by_class.setdefault(type(event), []).append(event)
    request_deltas = None
    with db.atomic():
        for cls, group in by_class.items():
            codec = schema.codec_for(cls)
            rows = [codec.encode(run_id, event) for event in group]
            if cls.TABLE == schema.REQUESTS_TABLE:  # several states of one request in a batch: the last one wins
                rows = list({row[codec.columns.index("request_id")]: row for row in rows}.values())
                # read before the upsert replaces them: totals add new state minus stored state
                request_deltas = run_totals.upsert_deltas(db.conn, run_id, codec.columns, rows)
            # executemany on a statement prepared once, not insert_all: values are
            # already encoded, and insert_all's per-value JSON check costs ~4x
            # (measured 27k vs 110k+ rows/s on the 2-core CI box).
            db.conn.executemany(codec.insert_sql, rows)
        # whole-run totals in the same transaction, so they always match the committed rows
        deltas = run_totals.batch_deltas(by_class, request_deltas)
        db.execute(_BATCH_UPDATE, [len(events), writer_wait_ns, num_dropped,
                                   *run_totals.update_params(deltas), run_id])


def insert_run_row(db: sqlite_utils.Database, started: RunStarted) -> int:
    """The run's row (with this process's pid and host, zeroed counters); returns its run_id."""
    row = schema.run_row(started)
    row.update(pid=os.getpid(), hostname=socket.gethostname(), writer_wait_ns=0,
               num_events=0, num_dropped=0, **run_totals.zeros())
    with db.atomic():
        return db["runs"].insert(row).last_pk


def finish_run_row(db: sqlite_utils.Database, run_id: int, status: str, *, writer_wait_ns: int,
                   num_dropped: int, last_error: str | None) -> None:
    """Status, finish time and the writer's counters on the run row."""
    with db.atomic():
        db.execute("UPDATE runs SET status = ?, finished_at = ?, writer_wait_ns = ?, num_dropped = ?, "
                   "writer_error = ? WHERE run_id = ?",
                   [status, time.time(), writer_wait_ns, num_dropped, last_error, run_id])
