"""When the telemetry writer checkpoints its WAL, and how.

Readers (the dashboard) poll the store while the engine writes, so the -wal file only shrinks
when a checkpoint copies its frames back into the database. The writer runs one at most every
``interval_s``: PASSIVE (never waits for readers) normally, TRUNCATE once the -wal outgrows
``wal_limit_bytes``. A checkpoint with nothing new committed since one that copied every frame
is skipped: a blocked or idle engine must not burn a checkpoint per second beside the readers.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import time

log = logging.getLogger("telemetry.writer")

class WalCheckpointer:
    def __init__(self, db_path: str, interval_s: float, wal_limit_bytes: int) -> None:
        self._wal_path = db_path + "-wal"
        self._interval_s = interval_s
        self._wal_limit_bytes = wal_limit_bytes
        self._last = time.monotonic()
        self._batches_at_last = 0      # committed batches when the last checkpoint ran
        self._wal_copied = False       # that checkpoint copied every WAL frame (no reader held it back)
        self.num_checkpoints = 0       # periodic checkpoints run (none while nothing is written)

    def maybe_run(self, conn: sqlite3.Connection | None, flushed_batches: int) -> None:
        """The periodic checkpoint, when due and when something new was committed since the last one."""
        if time.monotonic() - self._last < self._interval_s:
            return
        if flushed_batches != self._batches_at_last or not self._wal_copied:
            self._batches_at_last = flushed_batches
            self._wal_copied = self.run(conn)
            self.num_checkpoints += 1
        self._last = time.monotonic()

    def run(self, conn: sqlite3.Connection | None, mode: str | None = None) -> bool:
        """PASSIVE, or TRUNCATE past the limit (or when ``mode`` says so).
        True when every WAL frame is now in the database file."""
        if conn is None:
            return False
        if mode is None:
            try:
                wal_bytes = os.path.getsize(self._wal_path)
            except OSError:
                wal_bytes = 0
            mode = "TRUNCATE" if wal_bytes > self._wal_limit_bytes else "PASSIVE"
        try:
            is_busy, wal_frames, copied_frames = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error as exc:  # a busy checkpoint is retried next interval
            log.debug("wal_checkpoint(%s) skipped: %s", mode, exc)
            return False
        return not is_busy and copied_frames == wal_frames
