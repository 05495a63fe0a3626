"""The telemetry writer: one thread owns the only write connection.

Producers (the engine's scheduler loop) call ``emit(event)``, which appends
the dataclass to a bounded deque: no JSON, no SQL, no lock on the hot path.
The writer thread wakes every ``flush_interval_s`` (or as soon as
``max_batch`` events wait), turns events into tuples and commits them in one
transaction per batch (``db.atomic()`` around one prepared ``executemany``
per table; see ``store_writes.commit_events`` for why not ``insert_all``).

Back-pressure, two regimes, both visible on the run row:
- store healthy, queue full: the producer *waits* (never a silent drop); the
  total wait is ``writer_wait_ns``.
- store failing (read-only, disk full, locked past the busy timeout): the
  writer keeps the failed batch, logs the error, sets ``writer.error`` and
  retries with exponential backoff. Blocking the engine on a broken disk would
  turn a telemetry fault into an outage, so while failing, events that do not
  fit the queue are *dropped and counted* in ``num_dropped`` (logged at
  ERROR level, stored on the run row when the store recovers).

Acknowledgment: events are committed in FIFO order, so ``flushed_events``
(and ``flushed_batches``) after a commit mean "the first N emitted events are
durable in the WAL"; ``flush()`` blocks until everything emitted so far is
committed.

Events are handed over by reference: do not mutate an event after ``emit``.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sqlite3
import threading
import time
from typing import Any

import sqlite_utils

from telemetry import store_writes
from telemetry.events import RunStarted
from telemetry.wal_checkpoint import WalCheckpointer

log = logging.getLogger("telemetry.writer")


class TelemetryWriteError(RuntimeError):
    """The store could not be opened or the run could not be created."""


@dataclasses.dataclass
class _Command:
    kind: str                       # start_run / flush / close
    payload: Any = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Any = None
    error: str | None = None


class TelemetryWriter:
    def __init__(self, db_path: str | os.PathLike, *, queue_size: int = 100_000,
                 flush_interval_s: float = 0.05, max_batch: int = 2000,
                 checkpoint_interval_s: float = 1.0, wal_limit_bytes: int = 32 << 20,
                 busy_timeout_ms: int = 5000, max_backoff_s: float = 5.0) -> None:
        if queue_size < max_batch:
            raise ValueError(f"queue_size ({queue_size}) must be >= max_batch ({max_batch})")
        self.db_path = os.fspath(db_path)
        self.run_id: int | None = None
        self.error: str | None = None          # current store error; None when healthy
        self.last_error: str | None = None     # most recent error even after recovery (run row)
        self.num_dropped = 0                   # events dropped while the store was failing
        self.writer_wait_ns = 0                # producers' total wait on a full queue
        self.flushed_batches = 0
        self.flushed_events = 0
        self._queue: collections.deque = collections.deque()
        self._queue_size = queue_size
        self._max_batch = max_batch
        self._flush_interval_s = flush_interval_s
        self._wal_limit_bytes = wal_limit_bytes
        self._busy_timeout_ms = busy_timeout_ms
        self._max_backoff_s = max_backoff_s
        self._is_failing = False
        self._is_closed = False
        self._is_abandoned = False             # close() gave up on a failing store
        self._wake = threading.Event()
        self._db: sqlite_utils.Database | None = None
        self._retry: list[Any] = []            # batch that failed, retried first
        self._checkpointer = WalCheckpointer(self.db_path, checkpoint_interval_s, wal_limit_bytes)
        self._thread = threading.Thread(target=self._loop, name="telemetry-writer", daemon=True)
        self._thread.start()

    # ---- producer side ----------------------------------------------------
    def start_run(self, started: RunStarted, *, timeout_s: float = 30.0) -> int:
        """Insert the run row; returns its run_id. Raises TelemetryWriteError if the store is unusable."""
        if self.run_id is not None:
            raise RuntimeError(f"this writer already owns run {self.run_id}")
        command = self._submit("start_run", started, timeout_s)
        if command.error is not None or not command.done.is_set():
            why = command.error or f"no answer from the writer thread within {timeout_s:.0f}s ({self.error})"
            raise TelemetryWriteError(f"cannot start a run in {self.db_path}: {why}")
        self.run_id = command.result
        return self.run_id

    def emit(self, event: Any) -> None:
        """Hand one event to the writer thread (cheap; blocks only when the queue is full)."""
        if self.run_id is None or self._is_closed:
            raise RuntimeError("emit() needs a started, not yet closed run (call start_run first)")
        queue = self._queue
        if len(queue) >= self._queue_size and not self._wait_for_room():
            return
        queue.append(event)
        if len(queue) == self._max_batch:
            self._wake.set()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until every event emitted before this call is committed; False on timeout/failure."""
        command = self._submit("flush", None, timeout_s)
        return command.done.is_set() and command.error is None

    def close(self, status: str = "finished", *, timeout_s: float = 30.0) -> None:
        """Drain everything, record status / finished time / counters on the run row, stop the thread."""
        if self._is_closed or not self._thread.is_alive():
            self._is_closed = True
            return
        command = self._submit("close", status, timeout_s)
        self._is_closed = True
        if not command.done.is_set():
            self._is_abandoned = True
            lost = len(self._queue) + len(self._retry)
            log.error("telemetry writer could not drain within %.0fs (%s); %d events lost",
                      timeout_s, self.error, lost)
        self._thread.join(timeout=max(1.0, self._max_backoff_s))

    def __enter__(self) -> "TelemetryWriter":
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        self.close("crashed" if exc_type is not None else "finished")

    def _submit(self, kind: str, payload: Any, timeout_s: float) -> _Command:
        command = _Command(kind, payload)
        if not self._thread.is_alive():  # it gave up (store unusable before any run): answer now
            command.error = self.error or "telemetry writer thread has stopped"
            command.done.set()
            return command
        self._queue.append(command)
        self._wake.set()
        command.done.wait(timeout_s)
        return command

    def _wait_for_room(self) -> bool:
        """Queue full: wait while the store is healthy; drop (counted) while it is failing."""
        start = time.perf_counter_ns()
        self._wake.set()
        while (len(self._queue) >= self._queue_size and not self._is_failing
               and self._thread.is_alive()):
            time.sleep(0.0002)
        self.writer_wait_ns += time.perf_counter_ns() - start
        if len(self._queue) < self._queue_size:
            return True
        self.num_dropped += 1
        if self.num_dropped == 1 or self.num_dropped % 10_000 == 0:
            log.error("telemetry store failing (%s): dropped %d events so far (counted in num_dropped)",
                      self.error or "writer thread stopped", self.num_dropped)
        return False

    # ---- writer thread ----------------------------------------------------
    def _loop(self) -> None:
        backoff_s = 0.05
        while not self._is_abandoned:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            try:
                is_closing = self._drain()
                if self._is_failing:
                    log.warning("telemetry store %s recovered (last error: %s)", self.db_path, self.error)
                    self.error = None
                self._is_failing = False
                backoff_s = 0.05
            except (sqlite3.Error, OSError) as exc:
                self._record_failure(exc)
                if self.run_id is None:  # no run yet: answer start_run with the error, stop
                    self._answer_all_commands(self.error)
                    return
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
                continue
            if is_closing:
                return
            self._maybe_checkpoint()

    def _record_failure(self, exc: BaseException) -> None:
        self.error = self.last_error = f"{type(exc).__name__}: {exc}"
        if not self._is_failing:
            log.error("telemetry store %s is failing: %s (retrying with backoff)", self.db_path, self.error)
        self._is_failing = True

    def _answer_all_commands(self, error: str | None) -> None:
        self._is_closed = True
        for item in [*self._retry, *self._queue]:
            if isinstance(item, _Command):
                item.error = error
                item.done.set()
        self._retry = []
        self._queue.clear()

    def _connection(self) -> sqlite_utils.Database:
        if self._db is None:
            self._db = store_writes.open_store(self.db_path, busy_timeout_ms=self._busy_timeout_ms,
                                               wal_limit_bytes=self._wal_limit_bytes)
        return self._db

    def _drain(self) -> bool:
        """Commit everything queued, one transaction per batch. Returns True when closing.

        A failed batch stays in ``_retry`` (and is retried first) until it commits;
        once its events are committed only its trailing command is retried.
        """
        db = self._connection()
        while True:
            batch = self._retry or self._take_batch()
            if not batch:
                return False
            self._retry = batch
            command = batch[-1] if isinstance(batch[-1], _Command) else None
            events = batch[:-1] if command is not None else batch
            if events:
                self._commit(db, events)
                self.flushed_batches += 1
                self.flushed_events += len(events)
                self._retry = [command] if command is not None else []
            if command is None:
                self._maybe_checkpoint()  # a producer that never lets the queue empty must not starve it
                continue
            if command.kind == "close":
                self._finish(db, command.payload)
            elif command.kind == "start_run":
                self._start_run(db, command)
            self._retry = []
            command.done.set()
            if command.kind == "close":
                return True

    def _take_batch(self) -> list[Any]:
        """Up to max_batch events, cut right after a command so commands keep their place."""
        queue, batch = self._queue, []
        while queue and len(batch) < self._max_batch:
            item = queue.popleft()
            batch.append(item)
            if isinstance(item, _Command):
                break
        return batch

    def _commit(self, db: sqlite_utils.Database, events: list[Any]) -> None:
        store_writes.commit_events(db, self.run_id, events, writer_wait_ns=self.writer_wait_ns,
                                   num_dropped=self.num_dropped)

    def _start_run(self, db: sqlite_utils.Database, command: _Command) -> None:
        command.result = self.run_id = store_writes.insert_run_row(db, command.payload)

    def _finish(self, db: sqlite_utils.Database, status: str) -> None:
        if self.run_id is not None:
            store_writes.finish_run_row(db, self.run_id, status, writer_wait_ns=self.writer_wait_ns,
                                        num_dropped=self.num_dropped, last_error=self.last_error)
        self._checkpointer.run(db.conn, mode="TRUNCATE")
        db.close()
        self._db = None

    def _maybe_checkpoint(self) -> None:
        self._checkpointer.maybe_run(None if self._db is None else self._db.conn, self.flushed_batches)

    @property
    def num_checkpoints(self) -> int:
        return self._checkpointer.num_checkpoints
