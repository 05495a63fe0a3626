"""The Live page's stream-lane timeline: a pure DataFrame -> Figure builder.

Lanes, top to bottom: ``events`` (preemption and lever-change markers),
``scheduler`` (one bar per forward, coloured by path), then one lane per
stream (``default``, ``prefill``, ``secondary``) with record / wait / sync
markers, GPU-timed intervals and record -> wait links.

Horizontal ``go.Bar`` (base=start, x=duration) gives a millisecond Gantt
chart; past ``WEBGL_THRESHOLD`` intervals the forwards become ``Scattergl``
line segments, which the browser draws on the GPU instead of as SVG.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.palette import KIND_SYMBOLS, PATH_COLORS, path_color

LANES = ("events", "scheduler", "default", "prefill", "secondary")
STREAM_LANES = ("default", "prefill", "secondary")
WEBGL_THRESHOLD = 10_000
# A constant uirevision keeps the user's zoom / pan across fragment refreshes.
TIMELINE_UIREVISION = "chunkscope-live-timeline"

_FORWARD_HOVER = (
    "tick %{customdata[0]} · %{customdata[1]}<br>"
    "start %{base:.2f} ms, %{x:.3f} ms<br>"
    "prefill tokens %{customdata[2]} · decode tokens %{customdata[3]}<br>"
    "chunk: request %{customdata[4]}, %{customdata[5]} tokens, decode width %{customdata[6]}"
    "<extra></extra>"
)
_SEGMENT_HOVER = (
    "%{customdata[0]} forwards · %{customdata[1]}<br>"
    "%{customdata[2]} tokens in this slice<extra></extra>"
)


def _forward_bars(forwards: pd.DataFrame) -> list[go.Bar]:
    traces = []
    for path, rows in forwards.groupby("path", sort=True):
        custom = rows[["tick", "path", "num_prefill_tokens", "num_decode_tokens",
                       "request_id", "chunk_len", "decode_width"]].astype(object)
        custom = custom.where(pd.notna(custom), "–")
        traces.append(go.Bar(
            name=f"{path} forward", y=["scheduler"] * len(rows), base=rows["start_ms"].tolist(),
            x=rows["dur_ms"].tolist(), orientation="h", marker_color=path_color(path),
            customdata=custom.values.tolist(), hovertemplate=_FORWARD_HOVER, width=0.6,
            legendgroup=str(path),
        ))
    return traces


def _forward_segments(segments: pd.DataFrame) -> list[go.Scattergl]:
    """One WebGL line trace per path: each interval is [start, end, gap]."""
    traces = []
    for path, rows in segments.groupby("path", sort=True):
        xs, ys, custom = [], [], []
        for start, end, count, tokens in zip(rows["start_ms"], rows["end_ms"],
                                              rows["num_ticks"], rows["num_tokens"]):
            xs += [start, end, None]
            ys += ["scheduler", "scheduler", None]
            custom += [[int(count), path, int(tokens)]] * 2 + [[None, None, None]]
        traces.append(go.Scattergl(
            name=f"{path} forward", x=xs, y=ys, mode="lines", customdata=custom,
            line={"color": path_color(path), "width": 14}, hovertemplate=_SEGMENT_HOVER,
            legendgroup=str(path),
        ))
    return traces


def _stream_traces(stream_events: pd.DataFrame, links: pd.DataFrame) -> list:
    traces: list = []
    timed = stream_events[stream_events["gpu_elapsed_ms"].notna()]
    if len(timed):
        traces.append(go.Bar(
            name="GPU-timed interval", y=timed["stream"].tolist(),
            base=(timed["t_ms"] - timed["gpu_elapsed_ms"]).tolist(), x=timed["gpu_elapsed_ms"].tolist(),
            orientation="h", marker_color="rgba(120,120,120,0.35)", width=0.4,
            hovertemplate="%{y}: %{x:.3f} ms on the device<extra></extra>",
        ))
    for kind, rows in stream_events.groupby("kind", sort=True):
        traces.append(go.Scatter(
            name=f"stream {kind}", x=rows["t_ms"].tolist(), y=rows["stream"].tolist(), mode="markers",
            marker={"symbol": KIND_SYMBOLS.get(str(kind), "circle"), "size": 9},
            customdata=rows[["event_name", "seq", "tick"]].astype(object).values.tolist(),
            hovertemplate=f"{kind} %{{customdata[0]}} (seq %{{customdata[1]}}, tick %{{customdata[2]}})"
                          "<br>%{y} at %{x:.2f} ms<extra></extra>",
        ))
    if len(links):
        xs, ys = [], []
        for r in links.itertuples(index=False):
            xs += [r.record_t_ms, r.wait_t_ms, None]
            ys += [r.record_stream, r.wait_stream, None]
        traces.append(go.Scatter(
            name="record → wait", x=xs, y=ys, mode="lines", hoverinfo="skip",
            line={"color": "rgba(90,90,90,0.6)", "width": 1, "dash": "dot"},
        ))
    return traces


def _marker_traces(preemptions: pd.DataFrame, lever_changes: pd.DataFrame) -> list[go.Scatter]:
    traces = []
    if len(preemptions):
        traces.append(go.Scatter(
            name="preemption", x=preemptions["t_ms"].tolist(), y=["events"] * len(preemptions),
            mode="markers", marker={"symbol": "x", "size": 11, "color": "#d62728"},
            customdata=preemptions[["tick", "victim_request_id", "blocks_freed", "reason"]]
            .astype(object).values.tolist(),
            hovertemplate="preempted request %{customdata[1]} at tick %{customdata[0]}<br>"
                          "%{customdata[2]} blocks freed · %{customdata[3]}<extra></extra>",
        ))
    if len(lever_changes):
        traces.append(go.Scatter(
            name="lever change", x=lever_changes["t_ms"].tolist(), y=["events"] * len(lever_changes),
            mode="markers", marker={"symbol": "diamond", "size": 11, "color": "#ff7f0e"},
            customdata=lever_changes[["tick", "name", "old", "new", "status"]].astype(str).values.tolist(),
            hovertemplate="%{customdata[1]}: %{customdata[2]} → %{customdata[3]}"
                          " (%{customdata[4]} at tick %{customdata[0]})<extra></extra>",
        ))
    return traces


def timeline_figure(
    forwards: pd.DataFrame,
    stream_events: pd.DataFrame,
    links: pd.DataFrame,
    preemptions: pd.DataFrame,
    lever_changes: pd.DataFrame,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """Build the lane timeline.

    ``forwards`` holds either one row per tick (``start_ms``, ``dur_ms``, ``tick``,
    ``path``, token counts, chunk columns) or, when already downsampled in SQL,
    one row per (time bucket, path) with ``start_ms``, ``end_ms``, ``num_ticks``,
    ``num_tokens``. Bucketed rows, or more than ``WEBGL_THRESHOLD`` raw rows,
    are drawn as WebGL segments.
    """
    is_bucketed = "end_ms" in forwards.columns
    if is_bucketed:
        traces = _forward_segments(forwards)
    elif len(forwards) > WEBGL_THRESHOLD:
        as_segments = forwards.assign(
            end_ms=forwards["start_ms"] + forwards["dur_ms"], num_ticks=1,
            num_tokens=forwards["num_prefill_tokens"] + forwards["num_decode_tokens"])
        traces = _forward_segments(as_segments)
    else:
        traces = _forward_bars(forwards)
    traces += _stream_traces(stream_events, links) + _marker_traces(preemptions, lever_changes)
    fig = go.Figure(traces)
    fig.update_layout(
        barmode="overlay", uirevision=TIMELINE_UIREVISION, height=380,
        margin={"l": 10, "r": 10, "t": 30, "b": 40},
        legend={"orientation": "h", "y": 1.12},
        xaxis={"title": "ms since run start", "range": list(x_range) if x_range else None},
        yaxis={"type": "category", "categoryorder": "array", "categoryarray": list(reversed(LANES)),
               "range": [-0.5, len(LANES) - 0.5]},
    )
    return fig


__all__ = ["LANES", "STREAM_LANES", "WEBGL_THRESHOLD", "TIMELINE_UIREVISION", "timeline_figure", "PATH_COLORS"]
