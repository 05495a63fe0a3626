"""Levers: one widget per registered lever; a change rewrites levers.json atomically.

Widgets are keyed by the file version, so after any write (from here, another
tab or an editor) they are rebuilt from the file: the file is the truth.
"""
from __future__ import annotations

import streamlit as st

from dashboard import context, lever_state
from dashboard.queries import data
from dashboard.panels import tables
from dashboard.context import RunContext
from telemetry.echo import cut_echo
from telemetry.levers import LEVERS, LEVERS_BY_NAME, Lever, LeversError

st.title("Levers")


REFRESH_S = 1.0     # pending -> applied (or rejected) shows up without a reload
ERROR_KEY = "levers_error"
# A callback inside a fragment must not draw (Streamlit warns "A fragment rerun was triggered with a
# callback that displays one or more elements"): it leaves its toast here and the body shows it.
TOAST_KEY = "levers_toast"


def on_change(ctx: RunContext, name: str, key: str, telemetry_version: int | None, shown) -> None:
    value = st.session_state[key]
    try:
        if isinstance(value, str):   # int levers are typed as text: 12.7 or 99999999 get a message
            value = LEVERS_BY_NAME[name].parse_text(value)
        if not lever_state.is_change(name, value, shown, lever_state.read_pending(ctx.paths.levers)):
            return
        version = lever_state.write_change(ctx.paths.levers, name, value, telemetry_version)
    except (LeversError, OSError) as exc:
        st.session_state[ERROR_KEY] = cut_echo(f"{name}: not written: {exc}")   # a 10 kB value: its head
        return
    st.session_state[ERROR_KEY] = None
    st.session_state[TOAST_KEY] = f"{name} = {value!r} written to {ctx.paths.levers.name} (version {version})"


def on_reset(ctx: RunContext, telemetry_version: int | None) -> None:
    try:
        version = lever_state.reset_to_defaults(ctx.paths.levers, telemetry_version)
    except OSError as exc:
        st.session_state[ERROR_KEY] = f"reset: not written: {exc}"
        return
    st.session_state[ERROR_KEY] = None
    st.session_state[TOAST_KEY] = f"every lever reset to its default in {ctx.paths.levers.name} (version {version})"


def widget(lever: Lever, ctx: RunContext, pending: lever_state.PendingFile, row: lever_state.LeverRow,
           telemetry_version: int | None) -> None:
    key = f"lever_{lever.name}_v{pending.version or 0}"
    value = row.shown
    args = {"key": key, "help": lever.help, "on_change": on_change,
            "args": (ctx, lever.name, key, telemetry_version, value)}
    if lever.type is bool:
        st.toggle(lever.name, value=value, **args)
    elif lever.type is int:
        # A text box, not a number_input: that one clamps or truncates what the user typed in the
        # browser (99999999 -> max, 12.7 -> 12) without a word. Here every value is checked and
        # a bad one gets its message.
        args["help"] = f"{lever.help} Range: {lever.describe_range()}."
        st.text_input(lever.name, value=str(value), placeholder=lever.describe_range(), **args)
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
    if toast := st.session_state.pop(TOAST_KEY, None):
        st.toast(toast)
    if st.session_state.get(ERROR_KEY):
        st.error(st.session_state[ERROR_KEY])
    rows = {r.name: r for r in lever_state.lever_rows(pending, changes, ctx.run.get("levers") or {})}
    carried = lever_state.carried_over(list(rows.values()))
    if carried:
        named = ", ".join(f"`{name} = {value!r}`" for name, value in carried.items())
        st.warning(f"Levers carried over from an earlier run: when run {ctx.run_id} started, "
                   f"`{ctx.paths.levers.name}` (it outlives its run) already set {named} away from the defaults, "
                   "and the engine took them at tick 0. Change them below or reset every lever to its default.",
                   icon=":material/history:")
    st.caption(f"levers file `{ctx.paths.levers}` · version "
               f"{pending.version if pending.version is not None else '(none)'} · applied state from run {ctx.run_id}")
    st.button("Reset to defaults", key="levers_reset", on_click=on_reset, args=(ctx, telemetry_version),
              icon=":material/restart_alt:", help="write every lever's default into the levers file")
    for lever in LEVERS:
        row = rows[lever.name]
        left, right = st.columns([2, 3])
        with left:
            widget(lever, ctx, pending, row, telemetry_version)
        where = f"tick {row.applied_tick} ({row.applied_source})" if row.applied_tick is not None else "run start"
        asked = "not in the file" if row.pending is None else f"`{row.pending!r}`"
        text = f"**{row.state}** · pending {asked} · applied `{row.applied!r}` since {where}"
        if row.rejection:
            text += f"  \n:red[rejected: {cut_echo(row.rejection)}]"
        right.markdown(text)
    tables.show(lever_state.rows_table(list(rows.values())), key="levers_table")


@st.fragment(run_every=REFRESH_S)
def levers_area() -> None:
    context.run_page(render)


levers_area()
