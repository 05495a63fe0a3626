"""Is a process still there? Shared by crashed-run marking and the dashboard's run status."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def is_pid_alive(pid: Any) -> bool:
    """The pid names a live process on this host (a process we may not signal counts as alive)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)


def is_zombie(pid: int) -> bool:
    """Exited, waiting for its parent to collect it: a SIGKILLed engine is dead from this moment, though
    the signal check above still finds its pid (the parent, ./run.sh or a test, reaps it later)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def is_engine_pid(pid: Any) -> bool:
    """Alive and, where /proc tells, still running the engine (not a recycled pid)."""
    if not is_pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True     # no /proc: trust the signal check
    return b"engine" in cmdline
