"""The Live page's traffic strip (Streamlit calls only): API request rate, sources, first-token rules."""
from __future__ import annotations

import streamlit as st

from dashboard.queries import data
from dashboard.context import RunContext
from dashboard.panels.metric_row import Metric, metric_row

RULE_LABELS = {"min_tokens": "min_tokens (EOS banned)", "thinking": "thinking (think-end banned)",
               "force_tool_call": "forced tool-call start"}


def render(ctx: RunContext, end_ns: int, window_s: float) -> None:
    activity = data.api_activity(ctx.db, ctx.run_id, ctx.version, end_ns, float(window_s))
    api_url = (ctx.run.get("workload") or {}).get("api") if isinstance(ctx.run.get("workload"), dict) else None
    st.subheader("Traffic and first-token rules")
    st.caption(f"Over the newest {activity['num_requests']} requests"
               + (f"; the API serves {api_url}/v1" if api_url else "; this run serves no API"))
    by_source = activity["by_source"]
    metric_row([Metric(f"API requests/s (last {window_s} s)", f"{activity['api_rate']:.2f}"),
                Metric("requests api / workload", f"{by_source.get('api', 0)} / {by_source.get('workload', 0)}")]
               + ([Metric(RULE_LABELS.get(rule, rule), count) for rule, count in activity["rules"].items()]
                  or [Metric("first-token rules fired", 0)]))
