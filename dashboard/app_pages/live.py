"""Live: counters, the stream-lane timeline and latency percentiles, refreshed every second."""
from __future__ import annotations

import streamlit as st

from dashboard import charts, context, data, engine_panel, live_timeline, prefix_panel, spec_panel
from dashboard.context import RunContext
from dashboard.db import DataUnavailable

REFRESH_S = 1.0
WINDOWS_S = (2, 5, 10, 30, 60, 300)

st.title("Live")
ctx0 = context.current(quiet=True)
engine_panel.render(context.paths(), ctx0)
window_s = st.select_slider("timeline window (s)", WINDOWS_S, value=10, key="live_window_s")


def counters(ctx: RunContext, window_s: float) -> int | None:
    c = data.live_counters(ctx.db, ctx.run_id, ctx.version, float(window_s))
    if c is None:
        st.info(f"Run {ctx.run_id} has no ticks yet.")
        return None
    cols = st.columns([1, 1.3, 1, 1.5, 1.2, 1.2, 1.2, 1.3])    # room for "123 / 512" and 6-digit ticks
    cols[0].metric("waiting", c["num_waiting"])
    cols[1].metric("active (decoding)", c["num_active"])
    cols[2].metric("prefilling", c["num_prefilling"])
    cols[3].metric("KV blocks", f"{c['kv_blocks_used']} / {c['kv_blocks_total']}")
    cols[4].metric("SSM slots", f"{c['ssm_slots_used']} / {c['ssm_slots_total']}")
    cols[5].metric("decode tok/s", f"{c['decode_tok_s']:.1f}")
    cols[6].metric("prefill tok/s", f"{c['prefill_tok_s']:.1f}")
    cols[7].metric("tick", c["tick"])
    return int(c["t_ns"] + c["duration_ns"])


def render(ctx: RunContext) -> None:
    end_ns = counters(ctx, window_s)
    if end_ns is None:
        return
    age = context.seconds_since_last_row(ctx, end_ns)
    if ctx.is_running and age is not None and age > context.STALE_AFTER_S:
        st.warning(f"Run {ctx.run_id} is marked running but no tick has arrived for {age:.0f} s.")
    win = data.timeline_window(ctx.db, ctx.run_id, ctx.version, float(window_s))
    fig = charts.timeline_figure(win.forwards, win.stream_events, win.links, win.preemptions,
                                 win.lever_changes, (win.start_ms, win.end_ms))
    live_timeline.render(fig, key="live_timeline", revision=end_ns)   # stays mounted: no blank frame, zoom kept
    mode = "bucketed into WebGL segments" if win.is_bucketed else "one bar per forward"
    st.caption(f"last {window_s} s of run {ctx.run_id} ({ctx.run.get('status')}): {win.num_forwards} forwards, "
               f"{mode}; {len(win.stream_events)} stream events, {len(win.preemptions)} preemptions, "
               f"{len(win.lever_changes)} lever changes")
    latency = data.latency_percentiles(ctx.db, ctx.run_id, ctx.version)
    left, right = st.columns([2, 3])
    left.dataframe(latency.drop(columns="scope").round(2), hide_index=True, key="live_latency_table")
    left.caption(f"latency over the {latency['scope'].iloc[0]}")
    right.plotly_chart(charts.latency_figure(latency), key="live_latency", width="stretch")
    prefix_panel.render(ctx)
    spec_panel.render(ctx, window_s)


@st.fragment(run_every=REFRESH_S)
def live_area() -> None:
    context.run_page(render)


live_area()
