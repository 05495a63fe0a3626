"""``DIR/engine_status.json``: the running engine's heartbeat, readable without the database.

The telemetry store can fail (disk full, read-only directory) while the engine
keeps serving; the dashboard then cannot learn anything from ``telemetry.db``.
So the serve loop also rewrites this small file about once a second, atomically
(tmp file in the same directory + ``os.replace``): pid, run id, tick, queue
sizes, the telemetry error and the dropped-event count. A reader that finds
``updated_at`` older than a few seconds knows the engine is gone or stuck.

Writing it never raises: if the run directory itself is unwritable the serve
loop logs that once and goes on (the log is then the only report).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

STATUS_NAME = "engine_status.json"
STATUS_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0          # three missed heartbeats and then some
MAX_STATUS_BYTES = 64 * 1024

log = logging.getLogger("chunkscope.status")


def status_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / STATUS_NAME


def write_engine_status(path: str | os.PathLike, status: dict[str, Any]) -> str | None:
    """Atomically replace ``path`` with ``status`` as JSON; returns None, or the OSError text."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    body = json.dumps(status, sort_keys=True, allow_nan=False).encode() + b"\n"
    tmp_path = None
    try:
        fd, tmp_path = tempfile.mkstemp(prefix=".engine_status-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
        os.replace(tmp_path, path)
        tmp_path = None
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    finally:
        if tmp_path is not None:
            try:
                os.unlink(tmp_path)
            except OSError:
                pass


def read_engine_status(run_dir: str | os.PathLike, *, now: float | None = None) -> dict[str, Any] | None:
    """The last heartbeat plus ``is_stale`` (bool), or None when there is no readable status file."""
    path = status_path(run_dir)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_STATUS_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_STATUS_BYTES:
        return None
    try:
        status = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(status, dict) or not isinstance(status.get("updated_at"), (int, float)):
        return None
    now = time.time() if now is None else now
    status["is_stale"] = now - status["updated_at"] > STALE_AFTER_S
    return status


class StatusReporter:
    """Rewrites the status file at most every ``interval_s``; logs a failure once per new error."""

    def __init__(self, run_dir: str | os.PathLike, *, interval_s: float = STATUS_INTERVAL_S) -> None:
        self.path = status_path(run_dir)
        self.interval_s = interval_s
        self.started_at = time.time()
        self.num_writes = 0
        self._last_write = float("-inf")
        self._last_error: str | None = None

    def maybe_write(self, fields: dict[str, Any], *, force: bool = False) -> bool:
        """Write when the interval has passed (or ``force``); True when a write was attempted."""
        now = time.monotonic()
        if not force and now - self._last_write < self.interval_s:
            return False
        self._last_write = now
        status = {**fields, "pid": os.getpid(), "started_at": self.started_at, "updated_at": time.time()}
        error = write_engine_status(self.path, status)
        if error != self._last_error:
            if error is not None:
                log.error("cannot write the engine status file (run dir unwritable?): %s", error)
            else:
                log.warning("engine status file writable again: %s", self.path)
            self._last_error = error
        self.num_writes += error is None
        return True
