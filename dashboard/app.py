"""Chunkscope dashboard: a thin router.

    streamlit run dashboard/app.py -- --run-dir runs/default

Sets the page up, draws the run picker in the sidebar and hands over to the
page modules in ``app_pages/`` (Live first).
"""
from __future__ import annotations


import streamlit as st

from dashboard import context, fragment_timing, page_style, request_links
from dashboard.queries import data
from dashboard.panels import status_banner
from dashboard.queries.db import DataUnavailable

st.set_page_config(page_title="Chunkscope", page_icon=":material/biotech:", layout="wide")
PAGES = [
    st.Page("app_pages/live.py", title="Live", icon=":material/monitoring:", default=True),
    st.Page("app_pages/chunks.py", title="Chunks", icon=":material/view_column:"),
    st.Page("app_pages/requests.py", title="Requests", icon=":material/list_alt:"),
    st.Page("app_pages/levers.py", title="Levers", icon=":material/tune:"),
    st.Page("app_pages/runs.py", title="Runs", icon=":material/compare:"),
]


STATUS_REFRESH_S = 2.0
LINKED_RUN_KEY = "linked_run"     # the run a link already picked


def run_picker() -> None:
    paths = context.paths()
    st.sidebar.caption(f"run dir `{paths.run_dir}`")
    try:
        runs = data.list_runs(str(paths.db))
    except DataUnavailable:
        return  # the page says why
    if runs.empty:
        return
    # Labels never carry the status: the browser sends the picked label back, and a label that
    # changed under it (running -> finished) would no longer name an option.
    labels = {context.LATEST: "latest run"}
    labels.update({int(r.run_id): f"run {int(r.run_id)} · {r.model}" for r in runs.itertuples()})
    follow_run_link(labels)
    if st.session_state.get(context.RUN_KEY, context.LATEST) not in labels:
        st.session_state[context.RUN_KEY] = context.LATEST
    st.sidebar.selectbox("run", list(labels), format_func=labels.get, key=context.RUN_KEY)
    with st.sidebar:
        chosen_run_status(str(paths.db))


def follow_run_link(labels: dict) -> None:
    """``?run=3`` (a link from a chunk decision to its request) picks that run, once per link."""
    run_id = request_links.linked_value(st.query_params, request_links.RUN_PARAM)
    if run_id is None or run_id not in labels or st.session_state.get(LINKED_RUN_KEY) == run_id:
        return
    st.session_state[LINKED_RUN_KEY] = run_id
    st.session_state[context.RUN_KEY] = run_id


@st.fragment(run_every=STATUS_REFRESH_S)
@fragment_timing.timed("sidebar_status")
def chosen_run_status(db: str) -> None:
    """The chosen run's status, kept current (running -> finished shows up without a reload)."""
    try:
        runs = data.list_runs(db)
        run_id = context.chosen_run_id(db)
    except DataUnavailable:
        return
    if run_id is not None:
        st.caption(f"run {run_id}: {runs.loc[runs['run_id'] == run_id, 'status'].iloc[0]}")


@fragment_timing.timed("script")
def main() -> None:
    page_style.apply()
    run_picker()
    status_banner.render(context.paths().run_dir)
    st.navigation(PAGES).run()


fragment_timing.configure_from_env()
main()
