"""The grammar strip of the Requests page (Streamlit calls only): constrained requests and whether
their output validated, the mask's share of tick time, preemptions that passed over grammar holders."""
from __future__ import annotations

import streamlit as st

from dashboard.queries import data
from dashboard.panels import tables
from dashboard.context import RunContext
from dashboard.panels.metric_row import Metric, metric_row
from dashboard.queries.grammar import RECENT_TICKS


def render(ctx: RunContext) -> None:
    s = data.grammar_summary(ctx.db, ctx.run_id, ctx.version)
    st.subheader("Structured output")
    if s is None:
        st.caption("This store was written before grammar-constrained decoding: no grammar data.")
        return
    if not s["num"]:
        st.caption("No request in this run carries a grammar (serve --grammar-share F draws some).")
        return
    share = s["mask_share"]
    metric_row([
        Metric("grammar requests", s["num"]),
        Metric("output validated", f"{s['num_valid']} / {s['num']}",
               help=f"{s['num_invalid']} ended incomplete (finish_reason length); the rest are in flight"),
        Metric("mask share of tick time", "–" if share is None else f"{share:.1%}",
               help=f"grammar mask fill + apply over the newest {RECENT_TICKS:,} ticks"),
        Metric("constrained rows / masked tick",
               f"{s['num_rows'] / s['num_masked_ticks']:.1f}" if s["num_masked_ticks"] else "–"),
        Metric("preemptions that skipped holders", f"{s['num_with_skips']} / {s['num_preemptions']}",
               help=f"{s['num_skipped']} grammar holders passed over in all (they are never victims)"),
    ])
    tables.show(s["by_kind"], key="grammar_by_kind")
