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

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from telemetry.levers import LeverValues, LeversReadResult, read_levers_file

log = logging.getLogger("chunkscope.levers")

STAT_RECHECK_S = 1.0


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

    def on_any_event(self, event: FileSystemEvent) -> None:
        # An atomic replace arrives as a move whose destination is the file.
        paths = {os.fspath(event.src_path), os.fspath(getattr(event, "dest_path", "") or "")}
        if self._path in paths:
            self._flag.set()


class LeverWatcher:
    """Turns levers-file events into validated updates, at most one rejection log per bad content."""

    def __init__(self, path: str | os.PathLike, base: LeverValues, *, use_observer: bool = True) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.base = base                     # defaults + environment: what the file overrides
        self._dirty = threading.Event()
        self._dirty.set()                    # read once at start
        self._observer: Observer | None = None
        self._last_stat: tuple[int, int] | None = None
        self._last_stat_check = 0.0
        self._last_rejected_digest: str | None = None
        self.applied_version: int | None = None
        if use_observer:
            self._start_observer()

    def _start_observer(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        try:
            observer = Observer()
            observer.schedule(_FlagOnChange(self.path, self._dirty), directory, recursive=False)
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

    def _stat_changed(self) -> bool:
        now = time.monotonic()
        if now - self._last_stat_check < STAT_RECHECK_S:
            return False
        self._last_stat_check = now
        try:
            st = os.stat(self.path)
            stat = (st.st_mtime_ns, st.st_size)
        except OSError:
            stat = None
        changed = stat != self._last_stat
        self._last_stat = stat
        return changed

    def poll(self, current: LeverValues) -> LeverUpdate | None:
        """Called at a tick boundary; returns an update when the file changed since the last poll."""
        if not (self._dirty.is_set() or self._stat_changed()):
            return None
        self._dirty.clear()
        result = _read_regular_file(self.path, self.base)
        if result is None:
            return None                      # deleted: keep the last good values
        if result.error is not None:
            digest = _digest(self.path)
            if digest == self._last_rejected_digest:
                return None                  # already reported this exact bad content
            self._last_rejected_digest = digest
            log.warning("levers: rejected, keeping previous values: %s", result.error)
            return LeverUpdate(current, {}, None, result.error)
        self._last_rejected_digest = None
        self.applied_version = result.version
        changes = result.values.changes_from(current)
        if not changes:
            return None
        return LeverUpdate(result.values, changes, result.version, None)


def _read_regular_file(path: str, base: LeverValues) -> LeversReadResult | None:
    """Read the file only if it is a regular file (opening a FIFO would block the loop); None if absent."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return LeversReadResult(base, None, {}, f"{path}: cannot read: {exc.strerror or exc}")
    if not stat.S_ISREG(mode):
        return LeversReadResult(base, None, {}, f"{path}: not a regular file (a directory, FIFO or device)")
    result = read_levers_file(path, base)
    return None if result.version is None and result.error is None else result  # removed meanwhile


def _digest(path: str) -> str:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # never open a FIFO: it would block
            return f"special:{st.st_mode}:{st.st_ino}"
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read(1 << 17)).hexdigest()
    except OSError as exc:
        return f"unreadable:{exc.errno}"
