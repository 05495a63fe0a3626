"""The engine status strip: running or not, and start / stop controls (Streamlit calls only)."""
from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from dashboard import context, engine_control, fragment_timing
from dashboard.engine_api_options import ApiOptions
from dashboard.context import RunContext
from dashboard.paths import RunPaths


REFRESH_S = 2.0   # the strip follows the engine: an exit shows up without a reload


@st.fragment(run_every=REFRESH_S)
@fragment_timing.timed("engine_strip")
def render_live(paths: RunPaths) -> None:
    """The strip, redrawn with the run as it is now (the page's run context goes stale)."""
    render(paths, context.current(quiet=True))


def render(paths: RunPaths, ctx: RunContext | None) -> None:
    status = engine_control.engine_status(paths)
    started_elsewhere = ctx is not None and ctx.is_running and not status.is_running
    if status.is_running:
        left, right = st.columns([4, 1])
        left.success(f"Engine running (pid {status.pid}, started from this dashboard). "
                     f"Log: `{paths.engine_log}`")
        if right.button("Stop engine", key="engine_stop", type="secondary"):
            st.toast(engine_control.stop_engine(paths))
            st.rerun()
        return
    if started_elsewhere:
        st.success(f"Engine running: run {ctx.run_id} is live (pid {ctx.run.get('pid')}, started outside "
                   "the dashboard; stop it where it was started).")
        return
    crashed = ctx is not None and ctx.run.get("status") == "crashed"
    if crashed:
        st.error(f"No engine running: run {ctx.run_id} crashed (its process, pid {ctx.run.get('pid')}, died "
                 "without closing the run). Every page still shows what it recorded; restart below.",
                 icon=":material/error:")
    else:
        st.warning("No engine running: no live process writes to this run directory, so nothing new will "
                   f"arrive. ({status.note})")
    start_form(paths, ctx, crashed)


def start_form(paths: RunPaths, ctx: RunContext | None, crashed: bool) -> None:
    """Start an engine; after a crash the form is open and holds the crashed run's model, workload, rate
    and API options (./run.sh's engine serves the API: the restarted one does too, where the user's
    clients are; a run that required an API key asks for it again, since the run never records it)."""
    settings = restart_settings(ctx.run if ctx is not None else {})
    api = settings.api
    with st.expander("Restart the engine" if crashed else "Start an engine", expanded=ctx is None or crashed):
        with st.form("engine_start"):
            cols = st.columns(5 if api.needs_key else 4)
            model = cols[0].text_input("model", value=settings.model,
                                       help="'tiny', 'tiny-chat', 'tiny-chat-moe' or a checkpoint directory "
                                            "inside the run directory")
            workload = cols[1].selectbox("workload", engine_control.WORKLOADS,
                                         index=engine_control.WORKLOADS.index(settings.workload))
            rate = cols[2].number_input("rate (requests/s)", min_value=0.1, max_value=engine_control.MAX_RATE,
                                        value=settings.rate, step=0.5)
            api_port = cols[3].text_input("API port", value=api.port, max_chars=5,
                                          help=f"the OpenAI-compatible API on {api.host}; blank: no API")
            api_key = cols[4].text_input("API key", type="password",
                                         help="the crashed run required one; it is never recorded") \
                if api.needs_key else ""
            if st.form_submit_button("Restart engine" if crashed else "Start engine"):
                try:
                    pid = engine_control.start_engine(paths, model, workload, rate, api, api_port, api_key)
                except engine_control.EngineControlError as exc:
                    st.error(f"Not started: {exc}")
                else:
                    st.toast(f"engine started (pid {pid})")
                    st.rerun()


@dataclass(frozen=True)
class StartSettings:
    model: str
    workload: str
    rate: float
    api: ApiOptions = ApiOptions()


def restart_settings(run: dict) -> StartSettings:
    """The start form's values: the run's own where the form can start them, else the defaults (a run of a
    model the form cannot name starts the tiny model); the API options from its command line."""
    workload = run.get("workload") or {}
    model = run.get("model") if run.get("model") in engine_control.BUILTIN_MODELS else "tiny"
    kind = workload.get("kind") if workload.get("kind") in engine_control.WORKLOADS else "synthetic"
    try:
        rate = float(workload.get("rate"))
    except (TypeError, ValueError):
        rate = 4.0
    rate = rate if 0.1 <= rate <= engine_control.MAX_RATE else 4.0
    return StartSettings(model, kind, rate, ApiOptions.from_run(run))
