"""The prefix-cache strip (Streamlit calls only): hit ratio over time, snapshot events, miss reasons.

Drawn on the Live page. A hybrid model's prefix cache needs an SSM snapshot
where a KV match stops; without one the hit silently drops to 0 %, so the
miss reasons are shown next to the ratio, not hidden in a table.
"""
from __future__ import annotations

import streamlit as st

from dashboard.figures import charts
from dashboard.queries import data
from dashboard.panels import tables
from dashboard.context import RunContext
from dashboard.panels.metric_row import Metric, metric_row

EVENT_LABELS = {"prefix_hit": "prefix hits", "prefix_ssm_cut": "hits cut by SSM", "snapshot_taken":
                "snapshots taken", "snapshot_restored": "snapshots restored", "snapshot_evicted": "snapshots evicted"}


def render(ctx: RunContext) -> None:
    scope, buckets, totals, reasons, counts = data.prefix_view(ctx.db, ctx.run_id, ctx.version)
    st.subheader("Prefix cache")
    if scope.num_requests is not None:
        st.caption(f"Over the {scope.label} (the Runs page has the whole run's hit ratio).")
    ratio = totals.get("hit_ratio")
    metric_row([Metric(f"hit ratio ({scope.label})", "–" if ratio is None else f"{ratio:.1%}",
                       help=f"{totals.get('hit_tokens', 0):,} of {totals.get('prompt_tokens', 0):,} prompt tokens "
                            f"came from the cache; {totals.get('num_hits', 0)} of {totals.get('num_requests', 0)} "
                            "admitted requests hit")]
               + [Metric(label, counts[kind]) for kind, label in EVENT_LABELS.items()])
    if buckets.empty:
        st.caption("No admitted request yet.")
        return
    left, right = st.columns([3, 2])
    if not totals.get("num_hits"):
        left.caption(f"No prefix hit yet: none of the {totals.get('num_requests', 0):,} admitted requests reused "
                     "cached blocks, so the ratio below stays at 0 %.")
    left.plotly_chart(charts.prefix_hit_figure(buckets), key="prefix_hit_chart", width="stretch")
    if reasons.empty:
        right.caption("No request recorded a prefix miss reason.")
    else:
        right.markdown("**Why hits stopped short** (requests by reason)")
        tables.show(reasons, key="prefix_miss_reasons", where=right)
