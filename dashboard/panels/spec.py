"""The speculation strip (Streamlit calls only): acceptance by kind, drafts per tick, dropped drafts.

Drawn on the Live page under the prefix-cache strip. The drafts chart shares the
Live timeline's window and time axis, so a drop marker sits at the same moment
as the fused forward that caused it.
"""
from __future__ import annotations

import streamlit as st

from dashboard.queries import data
from dashboard.figures import spec as spec_charts
from dashboard.panels import tables
from dashboard.context import RunContext
from dashboard.panels.metric_row import Metric, metric_row


def render(ctx: RunContext, window_s: float) -> None:
    view = data.spec_view(ctx.db, ctx.run_id, ctx.version, float(window_s))
    if view is None:
        return
    st.subheader("Speculation")
    if view == "none":
        st.caption("No speculative step in this run (lever speculation off, or no lone decoding sequence).")
        return
    totals, buckets, steps, drops, window_ms = view
    metric_row([m for row in totals.itertuples() for m in (
        Metric(f"{row.spec_kind} acceptance", f"{row.acceptance:.0%}",
               help=f"{row.num_accepted:,} of {row.num_drafted:,} drafts over {row.num_steps:,} steps"),
        Metric(f"{row.spec_kind} tokens / step", f"{row.tokens_per_step:.2f}"))])
    left, right = st.columns([2, 3])
    left.plotly_chart(spec_charts.acceptance_figure(buckets), key="spec_acceptance", width="stretch")
    right.plotly_chart(spec_charts.drafts_timeline_figure(steps, drops, window_ms), key="spec_drafts",
                       width="stretch")
    if len(drops):
        st.markdown("**Drafts dropped** beside the fused tick that dropped them")
        tables.show(drops.drop(columns="t_ms"), key="spec_drops")
