"""Levers: one widget per registered lever; a change rewrites levers.json atomically.

Widgets are keyed by the file version, so after any write (from here, another
tab or an editor) they are rebuilt from the file: the file is the truth.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import context, data, lever_state
from dashboard.context import RunContext
from telemetry.levers import LEVERS, Lever, LeversError

st.title("Levers")


def on_change(ctx: RunContext, name: str, key: str, telemetry_version: int | None) -> None:
    value = st.session_state[key]
    try:
        version = lever_state.write_change(ctx.paths.levers, name, value, telemetry_version)
    except (LeversError, OSError) as exc:
        st.session_state["levers_error"] = f"{name}: not written: {exc}"
        return
    st.session_state["levers_error"] = None
    st.toast(f"{name} = {value!r} written to {ctx.paths.levers.name} (version {version})")


def widget(lever: Lever, ctx: RunContext, pending: lever_state.PendingFile, row: lever_state.LeverRow,
           telemetry_version: int | None) -> None:
    key = f"lever_{lever.name}_v{pending.version or 0}"
    args = {"key": key, "help": lever.help, "on_change": on_change,
            "args": (ctx, lever.name, key, telemetry_version)}
    value = row.shown
    if lever.type is bool:
        st.toggle(lever.name, value=value, **args)
    elif lever.type is int:
        lo, hi = lever.bounds or (None, None)
        st.number_input(lever.name, min_value=lo, max_value=hi, value=value, step=1, **args)
    else:
        choices = list(lever.choices or (value,))
        st.selectbox(lever.name, choices, index=choices.index(value), **args)


def render(ctx: RunContext) -> None:
    pending = lever_state.read_pending(ctx.paths.levers)
    changes = data.lever_changes(ctx.db, ctx.run_id, ctx.version)
    telemetry_version = lever_state.max_file_version(changes)
    if pending.error:
        st.warning(f"The levers file is rejected, so the engine keeps its previous values: {pending.error}. "
                   "A change here writes a fresh, valid file.")
    if st.session_state.get("levers_error"):
        st.error(st.session_state["levers_error"])
    st.caption(f"levers file `{ctx.paths.levers}` · version {pending.version if pending.version is not None else '(none)'}"
               f" · applied state from run {ctx.run_id}")
    rows = {r.name: r for r in lever_state.lever_rows(pending, changes, ctx.run.get("levers") or {})}
    for lever in LEVERS:
        row = rows[lever.name]
        left, right = st.columns([2, 3])
        with left:
            widget(lever, ctx, pending, row, telemetry_version)
        where = f"tick {row.applied_tick} ({row.applied_source})" if row.applied_tick is not None else "run start"
        asked = "not in the file" if row.pending is None else f"`{row.pending!r}`"
        text = f"**{row.state}** · pending {asked} · applied `{row.applied!r}` since {where}"
        if row.rejection:
            text += f"  \n:red[rejected: {row.rejection}]"
        right.markdown(text)
    table = pd.DataFrame([r.__dict__ for r in rows.values()]).astype(str)
    st.dataframe(table, hide_index=True, key="levers_table")


context.run_page(render)
