"""Runs a dead process left ``running``: marked ``crashed`` when the next engine starts on the store."""
from __future__ import annotations

import os
import socket
import sqlite3

import sqlite_utils

from telemetry import schema
from telemetry.procs import is_pid_alive


def mark_crashed_runs(db_path: str | os.PathLike) -> list[int]:
    """Mark runs left ``running`` by a dead process on this host as ``crashed``; returns their ids.

    Call at engine start. A run whose pid is alive (another engine) is left alone;
    runs from another host cannot be checked and are left alone too.
    """
    path = os.fspath(db_path)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return []
    db = sqlite_utils.Database(sqlite3.connect(path))
    try:
        schema.configure_connection(db)
        schema.ensure_schema(db)
        here = socket.gethostname()
        rows = db.execute("SELECT run_id, pid, hostname FROM runs WHERE status = 'running'").fetchall()
        crashed = [run_id for run_id, pid, host in rows
                   if host == here and pid is not None and pid != os.getpid() and not is_pid_alive(pid)]
        with db.atomic():
            for run_id in crashed:
                db.execute("UPDATE runs SET status = 'crashed' WHERE run_id = ?", [run_id])
        return crashed
    finally:
        db.close()
