"""The Live page's stream-lane timeline: a pure DataFrame -> Figure builder.

Lanes, top to bottom: ``events`` (preemption, lever-change and KV quantization state markers, and
each spell the engine was blocked as a bar here and a band across every lane),
``scheduler`` (one bar per forward, coloured by path), ``roofline`` (each
forward's share of its roofline, on a log scale from 1% to 100%), then one lane per
stream (``default``, ``prefill``, ``secondary``) with record / wait / sync
markers, GPU-timed intervals and record -> wait links; under expert
parallelism one lane per rank below them (``rank_lanes.py``).

Times arrive in ms since run start (the queries' unit) and are drawn in seconds since run
start (the x axis of every other chart); hovers give durations in ms.
Horizontal bars (base=start, x=duration) give a Gantt chart;
past ``WEBGL_THRESHOLD`` intervals the forwards become ``scattergl`` line
segments, which the browser draws on the GPU instead of as SVG.

The figure is built as a plain dict (``timeline_dict``), not as Plotly graph
objects: their validation (and the deep copy of the template) took 0.3-1.6 s
of a Live refresh on a loaded 2-core box, while one browser session runs one
fragment at a time, so the stall banner waited behind it. ``timeline_json``
serializes the dict without validation for the Live page; ``timeline_figure``
wraps it in a validated ``go.Figure`` (tests, notebooks), so the same spec is
checked against Plotly's schema there.
"""
from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from dashboard.figures.palette import FALLBACK_COLOR, KIND_COLORS, KIND_SYMBOLS, LEVER_COLOR, PATH_COLORS, path_color
from dashboard.figures.encoder_lane import LANE_NAME as ENCODER_LANE, encoder_lane_traces
from dashboard.figures.rank_lanes import empty_rank_forwards, rank_lane_traces
from dashboard.figures.roofline_lane import roofline_trace
from dashboard.figures.stall_band import stall_band

LANES = ("events", "scheduler", "roofline", "default", "prefill", "secondary")
STREAM_LANES = ("default", "prefill", "secondary")
WEBGL_THRESHOLD = 10_000
# A constant uirevision keeps the user's zoom / pan across fragment refreshes.
TIMELINE_UIREVISION = "chunkscope-live-timeline"

# Lanes sit at numeric y positions (top lane highest) labelled through tickvals:
# numeric arrays travel to the browser as typed binary arrays, which keeps a
# 10k-interval figure cheap to build and to serialize.
LANE_Y = {lane: float(len(LANES) - 1 - i) for i, lane in enumerate(LANES)}

_CHUNK_HOVER = ("<br>chunk: request %{customdata[3]}, %{customdata[4]} tokens, decode width %{customdata[5]}"
                "<br>%{text}")
MAX_LEVER_LINES = 20     # labelled vertical lines; more changes in the window stay markers only
_FORWARD_HOVER = (
    "tick %{customdata[0]} · %{fullData.name}<br>"
    "start %{base:.3f} s, %{customdata[6]:.3f} ms<br>"
    "prefill tokens %{customdata[1]} · decode tokens %{customdata[2]}"
)
_SEGMENT_HOVER = "%{customdata[0]} forwards · %{fullData.name}<br>%{customdata[1]} tokens in this slice<extra></extra>"
# customdata[3] is the request id a click opens (timeline_frontend/index.html)
_FORWARD_COLUMNS = ["tick", "num_prefill_tokens", "num_decode_tokens", "request_id", "chunk_len", "decode_width",
                    "dur_ms"]
MS_PER_S = 1000.0


def lane_y(lanes: pd.Series) -> np.ndarray:
    """Lane names -> y positions (unknown stream names go to the bottom lane)."""
    return lanes.map(LANE_Y).fillna(0.0).to_numpy(dtype=float)


def _forward_bars(forwards: pd.DataFrame) -> list[dict]:
    traces = []
    for path, rows in forwards.groupby("path", sort=True):
        has_chunk = path != "decode"
        traces.append(dict(
            type="bar", name=f"{path} forward", y=np.full(len(rows), LANE_Y["scheduler"]), text=_chunk_text(rows),
            textposition="none",
            base=rows["start_ms"].to_numpy(dtype=float), x=rows["dur_ms"].to_numpy(dtype=float),
            orientation="h", marker={"color": path_color(path)}, width=0.6, legendgroup=str(path),
            customdata=rows[_FORWARD_COLUMNS].to_numpy(dtype=float),
            hovertemplate=_FORWARD_HOVER + (_CHUNK_HOVER if has_chunk else "") + "<extra></extra>",
        ))
    return traces


def _chunk_text(rows: pd.DataFrame) -> list[str]:
    """Each forward's chunk decision for the hover: the cap rule that set its length, the mix blocker."""
    if "cap_rule" not in rows:
        return [""] * len(rows)
    caps = rows["cap_rule"].fillna("–").astype(str)
    blockers = rows["mix_blocker"].fillna("none").astype(str)
    return [f"cap rule {c} · mix blocker {b}<br>click: open this request on the Requests page"
            for c, b in zip(caps, blockers)]


def _forward_segments(segments: pd.DataFrame) -> list[dict]:
    """One WebGL line trace per path: each interval is (start, end, NaN gap)."""
    traces = []
    for path, rows in segments.groupby("path", sort=True):
        n = len(rows)
        xs = np.full(3 * n, np.nan)
        xs[0::3], xs[1::3] = rows["start_ms"].to_numpy(dtype=float), rows["end_ms"].to_numpy(dtype=float)
        custom = np.full((3 * n, 2), np.nan)
        custom[0::3] = custom[1::3] = rows[["num_ticks", "num_tokens"]].to_numpy(dtype=float)
        traces.append(dict(
            type="scattergl", name=f"{path} forward", x=xs, y=np.where(np.isnan(xs), np.nan, LANE_Y["scheduler"]),
            mode="lines",
            customdata=custom, line={"color": path_color(path), "width": 14}, hovertemplate=_SEGMENT_HOVER,
            legendgroup=str(path),
        ))
    return traces


def _stream_traces(stream_events: pd.DataFrame, links: pd.DataFrame) -> list:
    traces: list = []
    timed = stream_events[stream_events["gpu_elapsed_ms"].notna()]
    if len(timed):
        elapsed = timed["gpu_elapsed_ms"].to_numpy(dtype=float)
        traces.append(dict(
            type="bar", name="GPU-timed interval", y=lane_y(timed["stream"]),
            base=timed["t_ms"].to_numpy(dtype=float) - elapsed,
            x=elapsed, orientation="h", marker={"color": "rgba(120,120,120,0.35)"}, width=0.4, customdata=elapsed,
            hovertemplate="%{customdata:.3f} ms on the device<extra></extra>",
        ))
    for kind, rows in stream_events.groupby("kind", sort=True):
        # a wait is drawn on the stream it makes wait (target_stream), where the link lands
        lanes = rows["target_stream"].fillna(rows["stream"]) if "target_stream" in rows else rows["stream"]
        traces.append(dict(
            type="scatter", name=f"stream {kind}", x=rows["t_ms"].to_numpy(dtype=float), y=lane_y(lanes),
            mode="markers",
            marker={"symbol": KIND_SYMBOLS.get(str(kind), "circle"), "size": 9,
                    "color": KIND_COLORS.get(str(kind), FALLBACK_COLOR)},
            customdata=rows[["seq", "tick"]].to_numpy(dtype=float), text=rows["event_name"].astype(str).tolist(),
            hovertemplate=f"{kind} %{{text}} (seq %{{customdata[0]}}, tick %{{customdata[1]}})"
                          " at %{x:.3f} s<extra></extra>",
        ))
    if len(links):
        n = len(links)
        xs, ys = np.full(3 * n, np.nan), np.full(3 * n, np.nan)
        xs[0::3], xs[1::3] = links["record_t_ms"].to_numpy(dtype=float), links["wait_t_ms"].to_numpy(dtype=float)
        ys[0::3], ys[1::3] = lane_y(links["record_stream"]), lane_y(links["wait_stream"])
        traces.append(dict(
            type="scatter", name="record → wait", x=xs, y=ys, mode="lines", hoverinfo="skip",
            line={"color": "rgba(90,90,90,0.6)", "width": 1, "dash": "dot"},
        ))
    return traces


def _marker_traces(preemptions: pd.DataFrame, lever_changes: pd.DataFrame) -> list[dict]:
    traces = []
    if len(preemptions):
        traces.append(dict(
            type="scatter", name="preemption", x=preemptions["t_ms"].to_numpy(dtype=float),
            y=np.full(len(preemptions), LANE_Y["events"]), mode="markers",
            marker={"symbol": "x", "size": 11, "color": "#d62728"},
            customdata=preemptions[["tick", "victim_request_id", "blocks_freed"]].to_numpy(dtype=float),
            text=preemptions["reason"].astype(str).tolist(),
            hovertemplate="preempted request %{customdata[1]} at tick %{customdata[0]}<br>"
                          "%{customdata[2]} blocks freed · %{text}<extra></extra>",
        ))
    if len(lever_changes):
        text = [f"{r.name}: {r.old} → {r.new} ({r.status} at tick {r.tick})" for r in lever_changes.itertuples()]
        traces.append(dict(
            type="scatter", name="lever change", x=lever_changes["t_ms"].to_numpy(dtype=float),
            y=np.full(len(lever_changes), LANE_Y["events"]), mode="markers", text=text,
            marker={"symbol": "diamond", "size": 11, "color": LEVER_COLOR}, hovertemplate="%{text}<extra></extra>",
        ))
    return traces


def _kv_quant_traces(changes: pd.DataFrame | None) -> list[dict]:
    """InnerQ calibration state changes (calibrating -> ready -> applied) on the events lane."""
    if changes is None or not len(changes):
        return []
    text = [f"KV cache {r.old} → {r.new} at tick {r.tick}"
            + (f" ({int(r.tokens_seen)} prefill tokens calibrated)" if pd.notna(r.tokens_seen) else "")
            for r in changes.itertuples()]
    return [dict(
        type="scatter", name="KV quant state", x=changes["t_ms"].to_numpy(dtype=float),
        y=np.full(len(changes), LANE_Y["events"]), mode="markers+text", text=changes["new"].astype(str).tolist(),
        textposition="top center", hovertext=text, hovertemplate="%{hovertext}<extra></extra>",
        marker={"symbol": "star", "size": 13, "color": "#9467bd"},
    )]


def _in_seconds(traces: list[dict], shapes: list[dict], annotations: list[dict]) -> None:
    """Every x (ms since run start) to seconds, in place: bars' base and length, points, shapes."""
    for trace in traces:
        if trace.get("orientation") == "h" and "base" in trace:
            trace["base"] = np.asarray(trace["base"], dtype=float) / MS_PER_S
        if "x" in trace:
            trace["x"] = np.asarray(trace["x"], dtype=float) / MS_PER_S
    for shape in shapes:
        shape["x0"], shape["x1"] = shape["x0"] / MS_PER_S, shape["x1"] / MS_PER_S
    for note in annotations:
        if note.get("xref") == "x":
            note["x"] = note["x"] / MS_PER_S


@functools.cache
def _template() -> dict:
    """Plotly's "plotly_white" template as a dict, built once: the frame draws outside Streamlit's
    chart theme, and plotly.js knows no template names."""
    return pio.templates["plotly_white"].to_plotly_json()


def timeline_dict(
    forwards: pd.DataFrame,
    stream_events: pd.DataFrame,
    links: pd.DataFrame,
    preemptions: pd.DataFrame,
    lever_changes: pd.DataFrame,
    x_range: tuple[float, float] | None = None,
    stream_events_cap: int | None = None,
    kv_quant_changes: pd.DataFrame | None = None,
    rank_forwards: pd.DataFrame | None = None,
    encoder: pd.DataFrame | None = None,
    stalls: pd.DataFrame | None = None,
) -> dict:
    """Build the lane timeline as a plain Plotly figure dict (``{"data": [...], "layout": {...}}``).

    ``forwards`` holds either one row per tick (``start_ms``, ``dur_ms``, ``tick``,
    ``path``, token counts, chunk columns) or, when already downsampled in SQL,
    one row per (time bucket, path) with ``start_ms``, ``end_ms``, ``num_ticks``,
    ``num_tokens``. Bucketed rows, or more than ``WEBGL_THRESHOLD`` raw rows,
    are drawn as WebGL segments. Applied lever changes are labelled vertical lines. ``stalls``
    (``start_ms``, ``end_ms``, ``blocker``, ``is_open``): spells the engine was blocked.
    ``x_range`` is in ms like the rows; the figure's x axis is in seconds.
    ``stream_events_cap``: the stream events were cut at this many; the chart says so.
    ``encoder``: vision-tower runs and encoder-cache hits (``encoder_lane.py``), a lane below the ranks'.
    """
    is_bucketed = "end_ms" in forwards.columns
    webgl = is_bucketed or len(forwards) > WEBGL_THRESHOLD
    if is_bucketed:
        traces = _forward_segments(forwards)
    elif webgl:
        as_segments = forwards.assign(
            end_ms=forwards["start_ms"] + forwards["dur_ms"], num_ticks=1,
            num_tokens=forwards["num_prefill_tokens"] + forwards["num_decode_tokens"])
        traces = _forward_segments(as_segments)
    else:
        traces = _forward_bars(forwards)
    traces += roofline_trace(forwards, webgl, LANE_Y["roofline"])
    traces += _stream_traces(stream_events, links) + _marker_traces(preemptions, lever_changes)
    traces += _kv_quant_traces(kv_quant_changes)
    # Expert parallelism: one lane per rank below the stream lanes (dashboard/figures/rank_lanes.py).
    rank_traces, rank_y, rank_names = rank_lane_traces(
        rank_forwards if rank_forwards is not None else empty_rank_forwards(), -1.0)
    traces += rank_traces
    if encoder is not None and not encoder.empty:
        encoder_y = -1.0 - len(rank_y)
        traces += encoder_lane_traces(encoder, encoder_y)
        rank_y, rank_names = rank_y + [encoder_y], rank_names + [ENCODER_LANE]
    stall_traces, stall_shapes, stall_notes = stall_band(stalls, LANE_Y["events"])
    traces = stall_traces + traces               # the band's bar under the markers of the events lane
    shapes, annotations = _lever_lines(lever_changes)
    shapes, annotations = stall_shapes + shapes, stall_notes + annotations
    _in_seconds(traces, shapes, annotations)
    if stream_events_cap:
        annotations.append({"text": f"stream events: only the newest {stream_events_cap:,} in this window are drawn",
                            "xref": "paper", "yref": "paper", "x": 0, "y": -0.18, "showarrow": False,
                            "xanchor": "left", "font": {"size": 11, "color": "#8c564b"}})
    # Drawn in its own frame (live_timeline.py), outside Streamlit's chart theme: an explicit
    # template (Streamlit's default one holds placeholder colours its own chart swaps) and
    # automargin so the lane names are not clipped.
    layout = {
        "template": _template(), "barmode": "overlay", "uirevision": TIMELINE_UIREVISION,
        "height": 380 + 40 * len(rank_y), "margin": {"l": 10, "r": 10, "t": 30, "b": 40},
        "legend": {"orientation": "h", "y": 1.12},
        "xaxis": {"title": {"text": "s since run start"},
                  **({"range": [x / MS_PER_S for x in x_range]} if x_range else {})},
        "yaxis": {"tickmode": "array", "tickvals": [LANE_Y[lane] for lane in LANES] + rank_y,
                  "ticktext": list(LANES) + rank_names, "range": [-0.5 - len(rank_y), len(LANES) - 0.5],
                  "zeroline": False, "fixedrange": True, "automargin": True},
        **({"shapes": shapes} if shapes else {}), **({"annotations": annotations} if annotations else {}),
    }
    return {"data": traces, "layout": layout}


def timeline_json(*args, **kwargs) -> str:
    """``timeline_dict`` as the JSON the browser gets (numeric arrays as typed binary arrays),
    serialized without graph-object validation: the Live page's fast path."""
    return pio.to_json(timeline_dict(*args, **kwargs), validate=False)


def timeline_figure(*args, **kwargs) -> go.Figure:
    """``timeline_dict`` as a validated ``go.Figure`` (same arguments)."""
    return go.Figure(timeline_dict(*args, **kwargs))


def _lever_lines(lever_changes: pd.DataFrame) -> tuple[list[dict], list[dict]]:
    """(shapes, annotations): a dashed vertical line per applied change, labelled name=value."""
    applied = lever_changes[lever_changes["status"] == "applied"] if len(lever_changes) else lever_changes
    shapes, annotations = [], []
    for change in applied.tail(MAX_LEVER_LINES).itertuples():
        x = float(change.t_ms)
        shapes.append({"type": "line", "x0": x, "x1": x, "xref": "x", "y0": 0, "y1": 1, "yref": "y domain",
                       "line": {"color": LEVER_COLOR, "width": 1, "dash": "dash"}})
        annotations.append({"x": x, "xref": "x", "y": 1, "yref": "y domain", "showarrow": False,
                            "xanchor": "left", "yanchor": "top", "textangle": -90,
                            "text": f"{change.name}={change.new}", "font": {"size": 10, "color": LEVER_COLOR}})
    return shapes, annotations


__all__ = ["LANES", "LANE_Y", "STREAM_LANES", "WEBGL_THRESHOLD", "TIMELINE_UIREVISION", "timeline_dict",
           "timeline_figure", "timeline_json", "PATH_COLORS"]
