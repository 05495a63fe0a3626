"""One engine per run directory: an exclusive ``flock`` on ``RUN_DIR/engine.lock`` naming the holder.

Two engines on one directory would share the heartbeat, the log and the levers
file, and each would mark the other's run crashed. The lock lives as long as
the process (the kernel drops it when the process dies, even by SIGKILL), so a
stale lock file from a dead engine never blocks the next start.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_NAME = "engine.lock"


class RunDirBusy(ValueError):
    """Another live engine holds the run directory (a user error: one line, exit 2)."""


def lock_run_dir(run_dir: Path) -> IO[str] | None:
    """Take the run directory's lock and write our pid in it; keep the returned file open while serving.

    None when the directory cannot hold a lock file at all (read-only): the engine then serves
    without one, as it serves without telemetry there.
    """
    path = Path(run_dir) / LOCK_NAME
    try:
        handle = open(path, "a+")
    except OSError:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirBusy(f"--run-dir {run_dir}: another engine (pid {holder}) is serving this directory; "
                         f"stop it first or pick another directory") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
