"""Live: counters, the stream-lane timeline and latency percentiles, refreshed every second.

A browser session runs one script or fragment at a time, and a fragment that comes due waits for the
one running. So the page is cut into short fragments: the stall line (0.5 s, a file read), the
counters and timeline (1 s, cached per timeline version, so a blocked engine's refresh is lookups),
and the slower-moving percentiles and panels (every DETAILS_REFRESH_S). Each one's run time is logged
by ``fragment_timing`` (``bench/stall.py`` prints them).
"""
from __future__ import annotations

import streamlit as st

from dashboard import context, fragment_timing, heartbeat_view, request_links
from dashboard.panels import api as api_panel
from dashboard.figures import charts
from dashboard.queries import data
from dashboard.panels import engine_process as engine_panel
from dashboard.panels import kv_gauges
from dashboard.panels import live_timeline
from dashboard.panels import prefix as prefix_panel
from dashboard.panels import spec as spec_panel
from dashboard.panels import tables
from dashboard.context import RunContext
from dashboard.queries.db import DataUnavailable
from dashboard.panels.metric_row import Metric, metric_row
from dashboard.queries.live import MAX_STREAM_EVENTS
from telemetry.engine_status import read_engine_status
from telemetry.procs import is_engine_pid

REFRESH_S = 1.0
BLOCKED_REFRESH_S = 0.5
DETAILS_REFRESH_S = 5.0   # percentiles over the newest requests, traffic, prefix cache, speculation: each redraw
# of their Plotly charts costs the browser more than the whole timeline (a CPU profile of the tab)
WINDOWS_S = (2, 5, 10, 30, 60, 300)
HANDLED_CLICK_KEY = "live_timeline_handled_click"

st.title("Live")
engine_panel.render_live(context.paths())
window_s = st.select_slider("timeline window (s)", WINDOWS_S, value=10, key="live_window_s")


def counters(c: dict, now: heartbeat_view.LiveState | None, is_running: bool) -> None:
    """The tick row's counters, or the heartbeat's when the ticks stopped (blocked, idle)."""
    shown = {**c, **now.counters} if now is not None else c
    tokens, size = kv_gauges.kv_gauges(c)   # from the tick row (the heartbeat carries blocks only)
    # A blocked or ended engine computes nothing: its last window's rate would be a stale claim.
    moving = is_running and now is None
    metric_row([
        Metric("waiting", shown["num_waiting"]),
        Metric("active (decoding)", shown["num_active"]),
        Metric("prefilling", shown["num_prefilling"]),
        Metric("KV blocks", f"{shown['kv_blocks_used']} / {shown['kv_blocks_total']}"),
        Metric("KV tokens", tokens, help="token slots of the blocks in use / in use + what the free bytes "
                                         "hold as new (full-precision) blocks"),
        Metric("KV MiB", size, help="bytes of the blocks in use / the KV byte budget"),
        Metric("SSM slots", f"{shown['ssm_slots_used']} / {shown['ssm_slots_total']}"),
        Metric("decode tok/s", f"{shown['decode_tok_s']:.1f}" if moving else "0.0" if is_running else "—"),
        Metric("prefill tok/s", f"{shown['prefill_tok_s']:.1f}" if moving else "0.0" if is_running else "—"),
        Metric("tick", shown["tick"]),
    ])
    if not is_running:
        st.caption("The run has ended: the counters are from its last tick; it computes nothing now.")


def open_clicked_request(ctx: RunContext, clicked: dict | None) -> None:
    """A click on a forward opens its request on the Requests page (once per click)."""
    target = request_links.clicked_request(clicked, st.session_state.get(HANDLED_CLICK_KEY))
    if target is None:
        return
    request_id, stamp = target
    st.session_state[HANDLED_CLICK_KEY] = stamp
    st.switch_page(request_links.REQUESTS_PAGE, query_params=request_links.link_params(ctx.run_id, request_id))


def engine_now(ctx: RunContext, last_tick_age_s: float | None) -> heartbeat_view.LiveState | None:
    status = read_engine_status(ctx.paths.run_dir)
    return heartbeat_view.live_state(status, ctx.run_id, is_engine_pid((status or {}).get("pid")), last_tick_age_s)


def render_now(ctx: RunContext) -> None:
    """Counters and the timeline: what moves every second."""
    key = data.timeline_version(ctx.db, ctx.run_id, ctx.version)
    c = data.live_counters(ctx.db, ctx.run_id, key, float(window_s))
    end_ns = int(c["t_ns"] + c["duration_ns"]) if c is not None else None
    age = context.seconds_since_last_row(ctx, end_ns)
    now = engine_now(ctx, age) if ctx.is_running else None
    if now is not None and not now.is_blocked:   # a stall is named by blocked_line, refreshed faster
        st.info(heartbeat_view.describe(now), icon=":material/pause_circle:")
    if c is None:
        st.info(f"Run {ctx.run_id} has no ticks yet.")
        return
    counters(c, now, ctx.is_running)
    if now is None and ctx.is_running and age is not None and age > context.STALE_AFTER_S:
        st.warning(f"Run {ctx.run_id} is marked running but no tick has arrived for {age:.0f} s.")
    open_end_ms = heartbeat_view.open_stall_end_ms(now)     # a stall still open is drawn up to now
    win = data.timeline_window(ctx.db, ctx.run_id, key, float(window_s), open_end_ms)
    cap = MAX_STREAM_EVENTS if win.stream_events_capped else None
    spec = data.timeline_spec(ctx.db, ctx.run_id, key, float(window_s), open_end_ms)
    clicked = live_timeline.render(spec, key="live_timeline", revision=end_ns)   # stays mounted: zoom kept
    open_clicked_request(ctx, clicked)
    mode = "bucketed into WebGL segments" if win.is_bucketed else "one bar per forward"
    st.caption(f"last {window_s} s of run {ctx.run_id} ({ctx.run.get('status')}): {win.num_forwards} forwards, "
               f"{mode}; {len(win.stream_events)} stream events{' (capped: newest only)' if cap else ''}, "
               f"{len(win.preemptions)} preemptions, "
               f"{len(win.lever_changes)} lever changes"
               + (f", blocked {sum(win.stalls['end_ms'] - win.stalls['start_ms']) / 1e3:.1f} s"
                  if len(win.stalls) else "")
               + kv_gauges.kv_quant_caption(data.kv_quant_status(ctx.db, ctx.run_id, ctx.version))
               + kv_gauges.kv_kind_caption(ctx.run.get("config")))


def render_details(ctx: RunContext) -> None:
    """Latency percentiles, traffic, prefix cache and speculation: aggregates that move slowly."""
    c = data.live_counters(ctx.db, ctx.run_id, data.timeline_version(ctx.db, ctx.run_id, ctx.version),
                           float(window_s))
    if c is None:
        return                          # the counters' fragment says there are no ticks yet
    end_ns = int(c["t_ns"] + c["duration_ns"])
    latency = data.latency_percentiles(ctx.db, ctx.run_id, ctx.version)
    # three fifths of the row: in two its count column sat past the box at 1280 px (issue 29, item 12)
    left, right = st.columns([3, 2])
    tables.show(latency.drop(columns="scope").round(2), key="live_latency_table", where=left)
    left.caption(f"latency over {latency['scope'].iloc[0]}")
    right.plotly_chart(charts.latency_figure(latency), key="live_latency", width="stretch")
    api_panel.render(ctx, end_ns, window_s)
    prefix_panel.render(ctx)
    spec_panel.render(ctx, window_s)


@st.fragment(run_every=BLOCKED_REFRESH_S)
@fragment_timing.timed("live_blocked_line")
def blocked_line() -> None:
    """The stall, named from the heartbeat: a light fragment of its own, so the heavy live area's
    render time does not delay it."""
    status = read_engine_status(context.paths().run_dir)
    if not (status or {}).get("is_blocked"):
        return                         # the usual case costs one small file read
    ctx = context.current(quiet=True)
    now = engine_now(ctx, None) if ctx is not None and ctx.is_running else None
    if now is not None and now.is_blocked:
        st.error(heartbeat_view.describe(now), icon=":material/pause_circle:")


@st.fragment(run_every=REFRESH_S)
@fragment_timing.timed("live_now")
def live_now() -> None:
    context.run_page(render_now)


@st.fragment(run_every=DETAILS_REFRESH_S)
@fragment_timing.timed("live_details")
def live_details() -> None:
    context.run_page(render_details, quiet=True)


blocked_line()
live_now()
live_details()
