"""What every page needs: the run directory, the chosen run, and one way to show "no data".

The run picker lives in the sidebar (``app.py``); its choice, "latest" or a
run id, is a view setting and so lives in the session. Everything else
(lever values, engine pid) lives on disk.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import streamlit as st

from dashboard.queries import data
from dashboard.queries.db import DataUnavailable
from dashboard.paths import RunPaths, current_paths

LATEST = "latest"
RUN_KEY = "chosen_run"
STALE_AFTER_S = 5.0       # a running run with no new tick for this long is "not receiving rows"


@dataclass(frozen=True)
class RunContext:
    paths: RunPaths
    db: str
    run_id: int
    version: tuple
    run: dict

    @property
    def is_running(self) -> bool:
        return self.run.get("status") == "running"


def paths() -> RunPaths:
    return current_paths()


def show_unavailable(exc: DataUnavailable) -> None:
    (st.info if exc.level == "info" else st.warning)(exc.message)


def chosen_run_id(db: str) -> int | None:
    runs = data.list_runs(db)
    if runs.empty:
        return None
    ids = [int(r) for r in runs["run_id"]]
    choice = run_choice(st.session_state.get(RUN_KEY, LATEST))
    return choice if choice in ids else ids[0]


def run_choice(value: object) -> int | None:
    """A picked run id, or None for "latest" and anything else (a stale label the browser sent back)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def current(*, quiet: bool = False) -> RunContext | None:
    """The chosen run, or None after telling the user why there is nothing to show.

    ``quiet``: no message (for widgets drawn before the page body, which speaks instead).
    """
    run_paths = paths()
    db = str(run_paths.db)
    try:
        run_id = chosen_run_id(db)
        if run_id is None:
            if not quiet:
                st.info(f"The telemetry database {db} has no runs yet: start an engine on this run directory.")
            return None
        version = data.run_version(db, run_id)
        run = data.run_row(db, run_id, version) or {}
    except DataUnavailable as exc:
        if not quiet:
            show_unavailable(exc)
        return None
    return RunContext(run_paths, db, run_id, version, run)


def run_page(render: Callable[[RunContext], None], *, quiet: bool = False) -> None:
    """Run a page body; a store problem mid-page becomes a message, never a stack trace.

    ``quiet``: say nothing when there is no run (a second part of a page whose first part says it).
    """
    ctx = current(quiet=quiet)
    if ctx is None:
        return
    try:
        render(ctx)
    except DataUnavailable as exc:
        show_unavailable(exc)


def seconds_since_last_row(ctx: RunContext, last_end_ns: int | None) -> float | None:
    """Wall-clock age of the newest tick (run start wall time + monotonic offset)."""
    started = ctx.run.get("started_at")
    if started is None or last_end_ns is None:
        return None
    return max(0.0, time.time() - (float(started) + last_end_ns / 1e9))
