"""Pure figure builders: small, already-aggregated DataFrames in, ``go.Figure`` out.

No Streamlit and no SQL here, so every builder is unit-tested directly. The
big timeline lives in ``timeline_chart.py``.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.figures.palette import path_color, phase_color
from dashboard.figures.timeline import timeline_figure, timeline_json  # re-exported: one import for pages

PERCENTILES = ("p50", "p90", "p99")
_MARGIN = {"l": 10, "r": 10, "t": 40, "b": 40}


def latency_figure(latency: pd.DataFrame) -> go.Figure:
    """Grouped bars: one group per metric (TTFT / ITL / e2e), one bar per percentile.

    ``latency`` columns: ``metric``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``count``.
    """
    fig = go.Figure()
    for pct in PERCENTILES:
        fig.add_trace(go.Bar(
            name=pct, x=latency["metric"].tolist(), y=latency[f"{pct}_ms"].tolist(),
            customdata=latency[["count"]].values.tolist(),
            hovertemplate=f"%{{x}} {pct}: %{{y:.2f}} ms (n=%{{customdata[0]}})<extra></extra>",
        ))
    fig.update_layout(barmode="group", height=300, margin=_MARGIN, yaxis_title="ms",
                      title="latency percentiles", uirevision="latency")
    return fig


def chunk_length_histogram(bins: pd.DataFrame) -> go.Figure:
    """``bins`` columns: ``bin_start``, ``bin_width``, ``path``, ``count`` (binned in SQL)."""
    fig = go.Figure()
    for path, rows in bins.groupby("path", sort=True):
        fig.add_trace(go.Bar(
            name=str(path), x=(rows["bin_start"] + rows["bin_width"] / 2).tolist(),
            y=rows["count"].tolist(), width=rows["bin_width"].tolist(), marker_color=path_color(path),
            customdata=list(zip(rows["bin_start"].tolist(), (rows["bin_start"] + rows["bin_width"]).tolist())),
            hovertemplate="%{customdata[0]}–%{customdata[1]} tokens: %{y} chunks<extra>%{fullData.name}</extra>",
        ))
    fig.update_layout(barmode="stack", height=300, margin=_MARGIN, title="chunk length",
                      xaxis_title="planned chunk tokens", yaxis_title="chunks", uirevision="chunk-hist")
    return fig


def mix_share_figure(share: pd.DataFrame) -> go.Figure:
    """Stacked 100 % bars per time bucket: mixed versus plain prefill chunks.

    ``share`` columns: ``bucket_s`` (bucket start, seconds since run start),
    ``num_mixed``, ``num_plain``.
    """
    fig = go.Figure([
        go.Bar(name="mixed", x=share["bucket_s"].tolist(), y=share["num_mixed"].tolist(),
               marker_color=path_color("mixed")),
        go.Bar(name="plain prefill", x=share["bucket_s"].tolist(), y=share["num_plain"].tolist(),
               marker_color=path_color("prefill")),
    ])
    fig.update_layout(barmode="stack", barnorm="percent", height=300, margin=_MARGIN,
                      title="mixed vs plain share over time", xaxis_title="s since run start",
                      yaxis_title="% of chunks", uirevision="mix-share")
    return fig


def waterfall_figure(phases: pd.DataFrame) -> go.Figure:
    """One row per request, one coloured span per lifecycle phase.

    ``phases`` columns: ``request_id``, ``phase`` (queued / prefilling /
    decoding / preempted / finished / error), ``start_ms``, ``end_ms``,
    ``detail``. Zero-length phases (finished, error) are drawn as markers.
    """
    fig = go.Figure()
    labels = phases["request_id"].map(lambda r: f"req {r}")
    spans = phases.assign(label=labels, dur_ms=phases["end_ms"] - phases["start_ms"])
    for phase, rows in spans[spans["dur_ms"] > 0].groupby("phase", sort=False):
        fig.add_trace(go.Bar(
            name=str(phase), y=rows["label"].tolist(), base=rows["start_ms"].tolist(),
            x=rows["dur_ms"].tolist(), orientation="h", marker_color=phase_color(phase),
            customdata=rows[["detail"]].astype(object).fillna("").values.tolist(),
            hovertemplate="%{y} " + str(phase) + ": %{base:.1f} → +%{x:.1f} ms %{customdata[0]}<extra></extra>",
        ))
    for phase, rows in spans[spans["dur_ms"] <= 0].groupby("phase", sort=False):
        fig.add_trace(go.Scatter(
            name=str(phase), y=rows["label"].tolist(), x=rows["start_ms"].tolist(), mode="markers",
            marker={"symbol": "line-ns-open" if phase == "finished" else "x", "size": 12,
                    "color": phase_color(phase)},
            customdata=rows[["detail"]].astype(object).fillna("").values.tolist(),
            hovertemplate="%{y} " + str(phase) + " at %{x:.1f} ms %{customdata[0]}<extra></extra>",
        ))
    num_rows = max(1, phases["request_id"].nunique())
    fig.update_layout(barmode="overlay", height=min(900, 120 + 22 * num_rows), margin=_MARGIN,
                      title="request waterfall", xaxis_title="ms since run start",
                      yaxis={"type": "category", "autorange": "reversed"}, uirevision="waterfall",
                      # Phases are milliseconds inside a run of minutes: the slider zooms the time axis
                      # until queued, prefill and decode spans are wide enough to read.
                      xaxis={"rangeslider": {"visible": True, "thickness": 0.08}})
    fig.update_traces(selector={"type": "bar"}, width=0.8)
    return fig


def runs_compare_figure(metrics: pd.DataFrame) -> go.Figure:
    """Latency percentiles of two (or more) runs side by side.

    ``metrics`` columns: ``run``, ``metric`` (e.g. "TTFT p50"), ``value_ms``.
    """
    fig = go.Figure()
    for run, rows in metrics.groupby("run", sort=False):
        fig.add_trace(go.Bar(name=str(run), x=rows["metric"].tolist(), y=rows["value_ms"].tolist(),
                             hovertemplate="%{x}: %{y:.2f} ms<extra>%{fullData.name}</extra>"))
    fig.update_layout(barmode="group", height=320, margin=_MARGIN, yaxis_title="ms",
                      title="latency percentiles by run", uirevision="runs-compare")
    return fig


def prefix_hit_figure(buckets: pd.DataFrame) -> go.Figure:
    """Prefix-cache hit ratio per arrival-time bucket (bars, %), with the bucket's token counts on hover.

    ``buckets`` columns: ``bucket_s``, ``bucket_width_s``, ``num_requests``, ``hit_tokens``,
    ``prompt_tokens``, ``hit_ratio`` (0..1).
    """
    fig = go.Figure(go.Bar(
        name="hit ratio", x=(buckets["bucket_s"] + buckets["bucket_width_s"] / 2).tolist(),
        y=(buckets["hit_ratio"] * 100).tolist(), width=(buckets["bucket_width_s"] * 0.95).tolist(),
        marker_color=phase_color("prefilling"),
        customdata=buckets[["num_requests", "hit_tokens", "prompt_tokens"]].values.tolist(),
        hovertemplate="%{x:.1f} s: %{y:.1f} % hit (%{customdata[1]} of %{customdata[2]} prompt tokens, "
                      "%{customdata[0]} requests)<extra></extra>",
    ))
    fig.update_layout(height=280, margin=_MARGIN, title="prefix-cache hit ratio by arrival time",
                      xaxis_title="s since run start", yaxis={"title": "% of prompt tokens", "range": [0, 100]},
                      uirevision="prefix-hit")
    return fig


__all__ = ["latency_figure", "prefix_hit_figure", "chunk_length_histogram", "mix_share_figure", "waterfall_figure",
           "runs_compare_figure", "timeline_figure", "timeline_json"]
