"""The engine status strip: running or not, and start / stop controls (Streamlit calls only)."""
from __future__ import annotations

import streamlit as st

from dashboard import context, engine_control, fragment_timing
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
    st.warning("No engine running: no live process writes to this run directory, so nothing new will "
               f"arrive. ({status.note})")
    with st.expander("Start an engine", expanded=ctx is None):
        with st.form("engine_start"):
            cols = st.columns(3)
            model = cols[0].text_input("model", value="tiny",
                                       help="'tiny' or a checkpoint directory inside the run directory")
            workload = cols[1].selectbox("workload", engine_control.WORKLOADS)
            rate = cols[2].number_input("rate (requests/s)", min_value=0.1, max_value=engine_control.MAX_RATE,
                                        value=4.0, step=0.5)
            if st.form_submit_button("Start engine"):
                try:
                    pid = engine_control.start_engine(paths, model, workload, rate)
                except engine_control.EngineControlError as exc:
                    st.error(f"Not started: {exc}")
                else:
                    st.toast(f"engine started (pid {pid})")
                    st.rerun()
