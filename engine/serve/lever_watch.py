"""Watch the levers file with watchdog; the loop applies what it finds between ticks.

The watchdog thread only raises a flag: reading, validating and applying the
file happens on the scheduler thread at a tick boundary, so a lever never
changes in the middle of a forward. A cheap stat check backs the observer up
(an editor writing in place, a filesystem without inotify).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass

from watchdog.events import (EVENT_TYPE_CLOSED_NO_WRITE, EVENT_TYPE_OPENED, FileCreatedEvent, FileDeletedEvent,
                             FileMovedEvent, FileSystemEvent, FileSystemEventHandler)
from watchdog.observers import Observer

from telemetry.levers import MAX_FILE_BYTES, LeverValues, LeversReadResult, levers_from_bytes

log = logging.getLogger("chunkscope.levers")

STAT_RECHECK_S = 1.0
# The inotify mask: an atomic replace (a move: how the dashboard and `levers set` write), a create,
# a delete. The directory also holds the telemetry store, whose -wal the engine's writer modifies
# ~20 times a second and an open dashboard opens and closes-after-write (its -wal / -shm) ~15 times
# a second; every delivered event woke the observer's threads, about 0.01-0.04 of a core while the
# engine was blocked (bench/stall.py, per thread). Modify / close-write are left out of the mask:
# an editor writing the file in place is seen by the stat check, within STAT_RECHECK_S.
WATCHED_EVENTS = [FileMovedEvent, FileCreatedEvent, FileDeletedEvent]


@dataclass(frozen=True)
class LeverUpdate:
    """What one look at the file found: new values to apply, or a rejection to log."""

    values: LeverValues
    changes: dict[str, tuple[object, object]]
    version: int | None
    error: str | None


class _FlagOnChange(FileSystemEventHandler):
    def __init__(self, path: str, flag: threading.Event) -> None:
        self._path = path
        self._flag = flag
        self.num_events = 0      # events delivered (a test proves the store's traffic is not)

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.num_events += 1
        # Our own read of the file raises open / close-without-write events: reacting to them
        # would re-read the file every tick (and re-log a refused lever every tick).
        if event.event_type in (EVENT_TYPE_OPENED, EVENT_TYPE_CLOSED_NO_WRITE):
            return
        # An atomic replace arrives as a move whose destination is the file.
        paths = {os.fspath(event.src_path), os.fspath(getattr(event, "dest_path", "") or "")}
        if self._path in paths:
            self._flag.set()


class LeverWatcher:
    """Turns levers-file events into validated updates: each file content is handed over once, so
    a rejection (by validation here, or by the engine refusing a value) is logged once per version."""

    def __init__(self, path: str | os.PathLike, base: LeverValues, *, use_observer: bool = True) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.base = base                     # defaults + environment: what the file overrides
        self._dirty = threading.Event()
        self._dirty.set()                    # read once at start
        self._observer: Observer | None = None
        self.handler: _FlagOnChange | None = None
        self._last_stat: tuple[int, int] | None = None
        self._last_stat_check = 0.0
        self._last_digest: str | None = None  # the content last handed over (applied, refused or rejected)
        self.applied_version: int | None = None
        self.num_reads = 0                   # file reads so far (a test proves unchanged files are not re-read)
        if use_observer:
            self._start_observer()

    def _start_observer(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        try:
            observer = Observer()
            self.handler = _FlagOnChange(self.path, self._dirty)
            observer.schedule(self.handler, directory, recursive=False, event_filter=WATCHED_EVENTS)
            observer.daemon = True
            observer.start()
            self._observer = observer
        except OSError as exc:  # inotify limits, odd filesystems: the stat check still works
            log.warning("levers: watchdog observer unavailable (%s); falling back to stat checks", exc)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None

    def wait_for_change(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until the observer flags the file; True when it did.

        The loop waits here when no step can run (a stall), instead of spinning.
        """
        return self._dirty.wait(timeout_s)

    def _stat_changed(self) -> bool:
        now = time.monotonic()
        if now - self._last_stat_check < STAT_RECHECK_S:
            return False
        self._last_stat_check = now
        stat = self._stat()
        changed = stat != self._last_stat
        self._last_stat = stat
        return changed

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def poll(self, current: LeverValues) -> LeverUpdate | None:
        """Called at a tick boundary; returns an update when the file changed since the last poll."""
        if not (self._dirty.is_set() or self._stat_changed()):
            return None
        self._dirty.clear()
        self._last_stat = self._stat()       # the stat check compares against what this read saw
        self.num_reads += 1
        found = _read_once(self.path, self.base)
        if found is None:
            return None                      # deleted: keep the last good values
        result, digest = found
        if digest == self._last_digest:
            return None                      # this exact content was already applied or rejected
        self._last_digest = digest
        if result.error is not None:
            log.warning("levers: rejected, keeping previous values: %s", result.error)
            return LeverUpdate(current, {}, None, result.error)
        self.applied_version = result.version
        changes = result.values.changes_from(current)
        if not changes:
            return None
        return LeverUpdate(result.values, changes, result.version, None)


def _read_once(path: str, base: LeverValues) -> tuple[LeversReadResult, str] | None:
    """Validate the file from ONE read, with the digest of exactly those bytes; None if absent.

    Reading twice (once to validate, once to fingerprint a rejection) would let a good file
    that lands in between be fingerprinted for the bad content and report it again.
    O_NONBLOCK: a FIFO in the file's place must never block the scheduler loop.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return LeversReadResult(base, None, {}, f"{path}: cannot read: {exc.strerror or exc}"), \
            f"unreadable:{exc.errno}"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return LeversReadResult(base, None, {}, f"{path}: not a regular file (a directory, FIFO or "
                                                f"device)"), f"special:{st.st_mode}:{st.st_ino}"
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(MAX_FILE_BYTES + 1)
    digest = hashlib.sha256(raw).hexdigest()
    return levers_from_bytes(raw, base, path, size=st.st_size), digest
