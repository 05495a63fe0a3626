"""Read-only SQLite access for the dashboard: short transactions, clear failure states.

Every query opens ``mode=ro`` (the dashboard can never write telemetry), runs
parameterized SQL, and closes. Anything that goes wrong with the store, be it
missing, locked, half-written or not a database at all, becomes
``DataUnavailable`` with a sentence for the user instead of a stack trace.
"""
from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from telemetry.ro_uri import read_only_uri

BUSY_TIMEOUT_S = 0.5    # a reader waits this long behind a WAL checkpoint before giving up


class DataUnavailable(Exception):
    """The telemetry store cannot answer right now. ``level`` is "info" or "warning"."""

    def __init__(self, message: str, level: str = "warning") -> None:
        super().__init__(message)
        self.message = message
        self.level = level


def connect_ro(db_path: Path | str) -> sqlite3.Connection:
    path = Path(db_path)
    if not path.exists():
        raise DataUnavailable(f"No telemetry database at {path} yet: start an engine on this run "
                              "directory and it will appear.", level="info")
    if path.stat().st_size == 0:
        raise DataUnavailable(f"The telemetry database {path} is empty: the engine is still creating it.",
                              level="info")
    try:
        conn = sqlite3.connect(read_only_uri(path), uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    except (sqlite3.Error, OSError) as exc:
        raise explain(exc, path) from None
    conn.execute("PRAGMA query_only = 1")
    return conn


def explain(exc: sqlite3.Error, path: Path | str) -> DataUnavailable:
    """Turn a SQLite error into the state the user should see."""
    text = str(exc)
    if "no such table" in text or "no such column" in text:
        return DataUnavailable(f"The telemetry database {path} is incomplete ({text}): it is being "
                               "created or was written by another version.", level="info")
    if "locked" in text or "busy" in text:
        return DataUnavailable(f"The telemetry database {path} is busy ({text}); the view retries "
                               "on the next refresh.")
    if "not a database" in text or "malformed" in text or "disk image" in text:
        return DataUnavailable(f"{path} is not a readable telemetry database ({text}).")
    return DataUnavailable(f"Cannot read {path}: {type(exc).__name__}: {text}")


def query_df(db_path: Path | str, sql: str, params: Sequence[Any] = ()) -> pd.DataFrame:
    """Run one parameterized SELECT and return its rows as a DataFrame."""
    with closing(connect_ro(db_path)) as conn:
        try:
            cursor = conn.execute(sql, tuple(params))
            columns = [d[0] for d in cursor.description or ()]
            return pd.DataFrame.from_records(cursor.fetchall(), columns=columns)
        except sqlite3.Error as exc:
            raise explain(exc, db_path) from None


def query_one(db_path: Path | str, sql: str, params: Sequence[Any] = ()) -> dict[str, Any] | None:
    """First row as a dict, or None."""
    with closing(connect_ro(db_path)) as conn:
        try:
            cursor = conn.execute(sql, tuple(params))
            row = cursor.fetchone()
        except sqlite3.Error as exc:
            raise explain(exc, db_path) from None
        if row is None:
            return None
        return dict(zip([d[0] for d in cursor.description], row))


def placeholders(values: Sequence[Any]) -> str:
    """``?, ?, ?`` for an IN list (values are still bound, never formatted in)."""
    return ", ".join("?" for _ in values)


def percentile_sql(values_cte: str) -> str:
    """Nearest-rank p50 / p90 / p99 (and n) of column ``v`` produced by ``values_cte``.

    ``values_cte`` is a SELECT yielding ``v``; sorting happens inside SQLite so
    only four numbers come back, whatever the row count.
    """
    return (
        f"WITH vals AS ({values_cte}), "
        "ranked AS (SELECT v, ROW_NUMBER() OVER (ORDER BY v) AS rn, COUNT(*) OVER () AS n "
        "FROM vals WHERE v IS NOT NULL) "
        "SELECT MAX(n) AS count, "
        "MAX(CASE WHEN rn = (n * 50 + 99) / 100 THEN v END) AS p50, "
        "MAX(CASE WHEN rn = (n * 90 + 99) / 100 THEN v END) AS p90, "
        "MAX(CASE WHEN rn = (n * 99 + 99) / 100 THEN v END) AS p99 FROM ranked"
    )
