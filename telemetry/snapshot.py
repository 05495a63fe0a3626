"""A consistent, pruned copy of one run taken from a live telemetry store.

``VACUUM INTO`` on a read-only connection copies the database as of one read
transaction, so the engine's writer keeps committing (WAL) while we copy and
the copy never holds half a batch. The copy is then ours to prune: other
runs' rows go, and with a time window the rows outside it, and the indexes
(``restore_indexes`` rebuilds them after extraction); a final VACUUM returns
the freed pages so the bundle stays small.
"""
from __future__ import annotations

import math
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from telemetry import ro_uri
from telemetry import events as ev
from telemetry import run_totals, schema

EVENT_TABLES = tuple(cls.TABLE for cls in ev.EVENT_TYPES if cls.TABLE != schema.REQUESTS_TABLE)


class SnapshotError(RuntimeError):
    """The source store cannot be snapshotted (missing, not SQLite, no such run)."""


MAX_WINDOW_S = 9.2e9          # SQLite's largest integer, in ns, is about 292 years


@dataclass(frozen=True)
class TimeWindow:
    """[since_ns, until_ns) in run-relative nanoseconds; None = open on that side."""

    since_ns: int | None = None
    until_ns: int | None = None

    def __post_init__(self) -> None:
        for name in ("since_ns", "until_ns"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"time window {name.removesuffix('_ns')} must be >= 0 s, got {value / 1e9:g} s")
        if self.since_ns is not None and self.until_ns is not None and self.until_ns <= self.since_ns:
            raise ValueError(f"time window is empty: until ({self.until_ns / 1e9:g} s) is not after since "
                             f"({self.since_ns / 1e9:g} s)")

    @property
    def is_windowed(self) -> bool:
        return self.since_ns is not None or self.until_ns is not None

    @classmethod
    def from_seconds(cls, since_s: float | None, until_s: float | None) -> "TimeWindow":
        def to_ns(name: str, seconds: float | None) -> int | None:
            if seconds is None:
                return None
            if not math.isfinite(seconds) or abs(seconds) > MAX_WINDOW_S:
                raise ValueError(f"time window {name} {seconds:g} s is not a time within a run "
                                 f"(at most {MAX_WINDOW_S:g} s)")
            return int(round(seconds * 1e9))
        return cls(to_ns("since", since_s), to_ns("until", until_s))


def read_only_uri(path: Path) -> str:
    return ro_uri.read_only_uri(path)


def latest_run_id(db_path: Path) -> int | None:
    with _open_source(db_path) as conn:
        return conn.execute("SELECT max(run_id) FROM runs").fetchone()[0]


def _open_source(db_path: Path) -> sqlite3.Connection:
    if not db_path.is_file():
        raise SnapshotError(f"telemetry store {db_path} does not exist")
    try:
        conn = sqlite3.connect(read_only_uri(db_path), uri=True, timeout=5.0, isolation_level=None)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        conn.execute("SELECT 1 FROM runs LIMIT 1").fetchone()
    except sqlite3.Error as exc:
        raise SnapshotError(f"telemetry store {db_path} cannot be read: {exc}") from None
    return conn


def take_snapshot(db_path: str | os.PathLike, run_id: int, dest: str | os.PathLike,
                  window: TimeWindow = TimeWindow()) -> None:
    """Write run ``run_id`` of the store at ``db_path`` (optionally windowed) to ``dest``."""
    db_path, dest = Path(db_path), Path(dest)
    if dest.exists():
        raise SnapshotError(f"snapshot destination {dest} already exists")
    source = _open_source(db_path)
    try:
        if source.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone() is None:
            raise SnapshotError(f"no run {run_id} in {db_path}")
        source.execute("VACUUM INTO ?", [str(dest)])
    except sqlite3.Error as exc:
        raise SnapshotError(f"cannot snapshot {db_path}: {exc}") from None
    finally:
        source.close()
    _prune(dest, run_id, window)


def _prune(path: Path, run_id: int, window: TimeWindow) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")  # a single self-contained file, no -wal beside it
        conn.execute("BEGIN")
        conn.execute("DELETE FROM runs WHERE run_id != ?", [run_id])
        for table in (*EVENT_TABLES, schema.REQUESTS_TABLE):
            conn.execute(f"DELETE FROM [{table}] WHERE run_id != ?", [run_id])
        if window.is_windowed:
            bounds = {"since": window.since_ns, "until": window.until_ns}
            for table in EVENT_TABLES:
                conn.execute(f"DELETE FROM [{table}] WHERE (:since IS NOT NULL AND t_ns < :since) "
                             "OR (:until IS NOT NULL AND t_ns >= :until)", bounds)
            # A request stays when its lifetime overlaps the window (arrival before the end,
            # and not finished before the start), so every row above keeps its request.
            conn.execute("DELETE FROM requests WHERE (:until IS NOT NULL AND coalesce(arrival_ns, t_ns) >= :until) "
                         "OR (:since IS NOT NULL AND finished_ns IS NOT NULL AND finished_ns < :since)", bounds)
        # The run row's totals must describe the rows the bundle holds (and fill them for older stores).
        run_totals.recompute(conn, [run_id])
        # Indexes are a fifth of the file and rebuild in milliseconds: ship without them.
        for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'idx_%'"
                                    ).fetchall():
            conn.execute(f"DROP INDEX [{name}]")
        conn.execute("COMMIT")
        conn.execute("VACUUM")
    finally:
        conn.close()


def restore_indexes(path: str | os.PathLike) -> None:
    """Recreate the store's query indexes in an extracted snapshot (the bundle ships without them)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for table, indexes in schema.INDEXES.items():
            for columns in indexes:
                conn.execute(f"CREATE INDEX IF NOT EXISTS [idx_{table}_{'_'.join(columns)}] ON [{table}] "
                             f"({', '.join(f'[{c}]' for c in columns)})")
    finally:
        conn.close()


def data_extent(conn: sqlite3.Connection) -> dict[str, int | None]:
    """First / last ``t_ns`` and tick over every event table of a snapshot."""
    parts = " UNION ALL ".join(f"SELECT min(t_ns) AS a, max(t_ns) AS b, min(tick) AS c, max(tick) AS d "
                               f"FROM [{table}]" for table in EVENT_TABLES)
    row = conn.execute(f"SELECT min(a), max(b), min(c), max(d) FROM ({parts})").fetchone()
    return {"first_ns": row[0], "last_ns": row[1], "first_tick": row[2], "last_tick": row[3]}


def table_counts(conn: sqlite3.Connection) -> dict[str, int]:
    return {table: conn.execute(f"SELECT count(*) FROM [{table}]").fetchone()[0] for table in ev.TABLES}
