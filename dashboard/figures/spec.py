"""Pure figure builders for speculation: acceptance over time by kind, drafts per tick with dropped drafts.

DataFrames from ``queries_spec`` in, ``go.Figure`` out; no Streamlit, no SQL.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.figures.palette import path_color, spec_kind_color

_MARGIN = {"l": 10, "r": 10, "t": 40, "b": 40}
ACCEPTANCE_UIREVISION = "spec-acceptance"
DRAFTS_UIREVISION = "spec-drafts"


def acceptance_figure(buckets: pd.DataFrame) -> go.Figure:
    """One line per speculation kind: accepted / drafted per time bucket.

    ``buckets`` columns: ``bucket_s``, ``spec_kind``, ``num_steps``, ``num_drafted``,
    ``num_accepted``, ``acceptance`` (``queries_spec.acceptance_over_time``).
    """
    fig = go.Figure()
    for kind, rows in buckets.groupby("spec_kind", sort=True):
        fig.add_trace(go.Scatter(
            name=str(kind), x=rows["bucket_s"].tolist(), y=rows["acceptance"].tolist(), mode="lines+markers",
            line={"color": spec_kind_color(kind)},
            customdata=rows[["num_accepted", "num_drafted", "num_steps"]].values.tolist(),
            hovertemplate="%{x:.1f} s: %{y:.0%} (%{customdata[0]}/%{customdata[1]} drafts, "
                          "%{customdata[2]} steps)<extra>%{fullData.name}</extra>",
        ))
    fig.update_layout(height=280, margin=_MARGIN, title="draft acceptance by kind",
                      xaxis_title="s since run start", yaxis={"title": "accepted / drafted", "range": [0, 1.05],
                                                          "tickformat": ".0%"},
                      uirevision=ACCEPTANCE_UIREVISION)
    return fig


def drafts_timeline_figure(steps: pd.DataFrame, drops: pd.DataFrame, window_ms: tuple[float, float]) -> go.Figure:
    """Drafted and accepted per speculative tick, and dropped drafts at the fused tick that dropped them.

    ``steps`` columns: ``t_ms``, ``tick``, ``spec_kind``, ``num_drafted``, ``num_accepted``,
    ``num_emitted``; ``drops``: ``t_ms``, ``tick``, ``num_dropped``, ``path``,
    ``num_prefill_tokens``, ``num_decode_tokens`` (the fused tick's row); ``window_ms`` in ms. Drawn on
    the Live timeline's axis: seconds since run start.
    """
    fig = go.Figure()
    if len(steps):
        custom = steps[["tick", "spec_kind", "num_emitted"]].values.tolist()
        fig.add_trace(go.Bar(name="drafted", x=(steps["t_ms"] / 1e3).tolist(), y=steps["num_drafted"].tolist(),
                             marker_color="#c7c7c7", customdata=custom,
                             hovertemplate="tick %{customdata[0]} (%{customdata[1]}): %{y} drafted<extra></extra>"))
        fig.add_trace(go.Bar(name="accepted", x=(steps["t_ms"] / 1e3).tolist(), y=steps["num_accepted"].tolist(),
                             marker_color=[spec_kind_color(k) for k in steps["spec_kind"]], customdata=custom,
                             hovertemplate="tick %{customdata[0]} (%{customdata[1]}): %{y} accepted, "
                                           "%{customdata[2]} emitted<extra></extra>"))
    if len(drops):
        fig.add_trace(go.Scatter(
            name="drafts dropped (fused tick)", x=(drops["t_ms"] / 1e3).tolist(), y=drops["num_dropped"].tolist(),
            mode="markers", marker={"symbol": "x", "size": 11, "color": [path_color(p) for p in drops["path"]]},
            customdata=drops[["tick", "path", "num_prefill_tokens", "num_decode_tokens"]].values.tolist(),
            hovertemplate="%{y} drafts dropped at tick %{customdata[0]}: a %{customdata[1]} forward of "
                          "%{customdata[2]} prefill + %{customdata[3]} decode tokens<extra></extra>"))
    fig.update_layout(barmode="overlay", bargap=0.1, height=260, margin=_MARGIN,
                      title="drafted / accepted per speculative tick; × = drafts dropped by a fused tick",
                      xaxis={"title": "s since run start", "range": [x / 1e3 for x in window_ms]},
                      yaxis_title="drafts", uirevision=DRAFTS_UIREVISION)
    return fig
