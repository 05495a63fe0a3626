"""Runs: all runs in the store, and two of them compared side by side with their lever settings."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import context
from dashboard.words import plural
from dashboard.panels import bundle as bundle_panel
from dashboard.figures import charts
from dashboard.queries import data
from dashboard.queries import runs as queries_runs
from dashboard.panels import tables
from dashboard.context import RunContext

st.title("Runs")


def _cell(value):
    return "–" if value is None or pd.isna(value) else round(value, 3)


def _local_time(epoch_s: pd.Series) -> pd.Series:
    """Epoch seconds as this machine's wall-clock time, to the second."""
    return pd.to_datetime(epoch_s, unit="s", utc=True).dt.tz_convert(None).dt.floor("s")


def _version(ctx: RunContext, run_id: int):
    return data.run_version(ctx.db, run_id)


def lever_settings_table(levers: dict[str, dict], later: dict[str, dict[str, str]]) -> pd.DataFrame:
    """One column per run (values at the first tick), "differs" between two runs, then the later changes."""
    table = pd.DataFrame(levers).map(lambda v: "" if v is None else str(v))
    if len(levers) == 2:
        first, second = table.columns
        table["differs"] = table[first] != table[second]
    for label, changes in later.items():
        if changes:
            table[f"changed later in {label.split(' (')[0]}"] = [changes.get(name, "") for name in table.index]
    return table


def render(ctx: RunContext) -> None:
    runs = data.list_runs(ctx.db)
    crashed = int((runs["status"] == "crashed").sum())
    st.markdown(f"**{plural(len(runs), 'run')}** in `{ctx.db}`" + (f", :red[{crashed} crashed]" if crashed else ""))
    listing = runs.drop(columns=["levers", "config", "workload", "started_at", "finished_at"]).assign(
        started=_local_time(runs["started_at"]), finished=_local_time(runs["finished_at"]))
    tables.show(listing, key="runs_table")
    ids = [int(r) for r in runs["run_id"]]
    cols = st.columns(2)
    a = cols[0].selectbox("run A", ids, index=0, key="runs_a")
    b = cols[1].selectbox("run B", ids, index=min(1, len(ids) - 1), key="runs_b")
    metrics, levers, later, scopes = {}, {}, {}, {}
    for run_id in dict.fromkeys([a, b]):
        version = _version(ctx, run_id)
        row = data.run_row(ctx.db, run_id, version) or {}
        label = f"run {run_id} ({row.get('status')})"
        metrics[label] = dict(data.run_metrics(ctx.db, run_id, version))
        scopes[label] = metrics[label].pop("latency scope")
        levers[label], later[label] = data.levers_in_effect(ctx.db, run_id, version, row.get("levers") or {})
    table = pd.DataFrame(metrics)
    st.subheader("Side by side")
    tables.show(table.map(_cell), key="runs_compare", hide_index=False)
    st.caption("latency percentiles over: " + "; ".join(f"{k}: {v}" for k, v in scopes.items()))
    latency = table.loc[[i for i in table.index if i.endswith(" ms")]]
    long = latency.reset_index(names="metric").melt(id_vars="metric", var_name="run", value_name="value_ms")
    long["metric"] = long["metric"].str.removesuffix(" ms")
    st.plotly_chart(charts.runs_compare_figure(long.dropna()), key="runs_latency", width="stretch")
    st.subheader("Roofline share per path")
    st.caption("Each forward's roofline (the least time this machine allows: FLOPs at its measured GEMM rate or "
               f"bytes at its read bandwidth, whichever is longer) over its measured time, with the GEMM rate "
               f"measured in the run's dtype; newest {queries_runs.ROOFLINE_RECENT_TICKS:,} forwards of each run. "
               f"A small model is overhead-bound: a few percent is a healthy tiny run.")
    roofline = pd.concat([data.roofline_by_path(ctx.db, run_id, _version(ctx, run_id)).assign(run=f"run {run_id}")
                          for run_id in dict.fromkeys([a, b])], ignore_index=True)
    if roofline.empty:
        st.info("No roofline recorded for these runs (the engine records one per tick when it measured "
                "the machine's rates at start).")
    else:
        tables.show(roofline.set_index(["run", "path"]).map(_cell), key="runs_roofline", hide_index=False)
    st.subheader("Lever settings at the first tick")
    st.caption("Defaults and environment, with the levers file the engine applied at tick 0; "
               "later changes are listed beside them.")
    tables.show(lever_settings_table(levers, later), key="runs_levers", hide_index=False)
    bundle_panel.render(ctx, a)


context.run_page(render)
