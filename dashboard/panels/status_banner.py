"""The engine heartbeat banner: a failing telemetry store or a stuck engine, shown on every page.

When the telemetry store fails (disk full, read-only directory) the database
stops telling the dashboard anything, so the engine's own heartbeat file,
``RUN_DIR/engine_status.json`` (``telemetry.engine_status``), is the only
source. ``banner_for`` is a pure decision (status dict in, message out) so it
is tested without Streamlit; ``render`` draws it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from dashboard import fragment_timing

from telemetry.engine_status import read_engine_status
from telemetry.procs import is_engine_pid

REFRESH_S = 2.0


@dataclass(frozen=True)
class Banner:
    level: str          # "error" / "warning"
    message: str


def banner_for(status: dict[str, Any] | None, is_alive: bool) -> Banner | None:
    """What the user must see about the engine, or None when all is well (or nothing is known).

    * telemetry_error while the engine serves -> error: the dashboard's data stops here;
    * telemetry_error in a run that has ended -> warning: its data is incomplete;
    * heartbeat stale while the pid lives -> warning: the loop is stuck or starved;
    * "serving" from a pid that is gone -> error: the engine crashed (killed, out of memory) without
      closing its run. The dashboard outlives it: every page reads what the run recorded.
    """
    if not status:
        return None
    error = status.get("telemetry_error")
    num_dropped = status.get("num_dropped") or 0
    pid, state, tick = status.get("pid"), status.get("state"), status.get("tick")
    is_serving = is_alive and state == "serving"
    if error and is_serving:
        return Banner("error", f"Telemetry store failing: {error}; {num_dropped:,} events dropped so far; the "
                               f"engine keeps serving (pid {pid}, tick {tick}). The pages below stop at the "
                               f"last rows it could write.")
    if error:
        return Banner("warning", f"The last engine run (pid {pid}, {state or 'ended'}) reported a telemetry "
                                 f"failure: {error}; {num_dropped:,} events were dropped, so its data is "
                                 f"incomplete.")
    if state == "serving" and not is_alive:
        return Banner("error", f"Engine crashed: run {status.get('run_id')} (pid {pid}) died at tick {tick} "
                               "without closing its run. Every page still shows what it recorded; start "
                               "a new engine from the Live page.")
    if status.get("is_stale") and is_alive and state == "serving":
        return Banner("warning", f"The engine (pid {pid}) is alive but its heartbeat "
                                 f"(engine_status.json) has not moved for "
                                 f"{max(0.0, _age_s(status)):.0f} s at tick {tick}: the loop is stuck or "
                                 f"starved of CPU.")
    return None


def _age_s(status: dict[str, Any]) -> float:
    return time.time() - float(status.get("updated_at") or 0.0)


def current_banner(run_dir: Path) -> Banner | None:
    status = read_engine_status(run_dir)
    return banner_for(status, is_engine_pid((status or {}).get("pid")))


@st.fragment(run_every=REFRESH_S)
@fragment_timing.timed("status_banner")
def render(run_dir: Path) -> None:
    banner = current_banner(run_dir)
    if banner is not None:
        (st.error if banner.level == "error" else st.warning)(banner.message, icon=":material/report:")
