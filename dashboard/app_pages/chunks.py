"""Chunks: every chunk decision, filterable, with the length histogram and mixed-vs-plain share."""
from __future__ import annotations

import streamlit as st

from dashboard import context, request_links
from dashboard.words import plural
from dashboard.figures import charts
from dashboard.queries import data
from dashboard.panels import tables
from dashboard.context import RunContext
from dashboard.queries.chunks import BLOCKERS, CAP_RULES, NEWEST_SCOPE, PATHS, ChunkFilter
from dashboard.queries.ids import BadSearch, parse_ids

TABLE_LIMIT = 500

st.title("Chunks")


def read_filter(min_tick: int | None) -> ChunkFilter | None:
    # The multi-selects get room for their chips: a quarter of the row showed one of two picked
    # blockers while both filtered (issue 29, item 6; page_style.py wraps the chips as well).
    cols = st.columns([1, 2])
    request = cols[0].text_input("request ids", key="chunks_request", placeholder="any · 12 · 3, 7 · 10-20",
                                 help="ids, ranges or the id the API returned (chatcmpl-…-12), as on Requests")
    paths = cols[1].multiselect("path", PATHS, key="chunks_path")
    cols = st.columns(2)
    caps = cols[0].multiselect("cap rule", CAP_RULES, key="chunks_cap")
    blockers = cols[1].multiselect("can-mix blocker", BLOCKERS, key="chunks_blocker")
    try:
        requests = parse_ids(request)
    except BadSearch as exc:
        st.error(f"request ids: {exc}")
        return None
    return ChunkFilter(requests, tuple(paths), tuple(caps), tuple(blockers), min_tick)


def filter_words(flt: ChunkFilter) -> str:
    """The applied filters in words (every picked value, whether or not its chip fits the box)."""
    parts = [f"{label} is {' or '.join(values)}" for label, values in
             (("path", flt.paths), ("cap rule", flt.cap_rules), ("blocker", flt.blockers)) if values]
    return f": {'; '.join(parts)}" if parts else ""


def render(ctx: RunContext) -> None:
    min_tick, num_total = data.chunk_scope(ctx.db, ctx.run_id, ctx.version)
    scope_note = ""
    if min_tick is not None:
        whole = st.toggle(f"whole run ({num_total:,} decisions; slower)", key="chunks_whole_run",
                          help=f"By default the page looks at the newest {NEWEST_SCOPE:,} decisions.")
        min_tick = None if whole else min_tick
        scope_note = "" if whole else f" among the newest {NEWEST_SCOPE:,} of {num_total:,}"
    flt = read_filter(min_tick)
    if flt is None:
        return
    count, table, hist, share = data.chunk_view(ctx.db, ctx.run_id, ctx.version, flt, TABLE_LIMIT)
    shown = f"newest {len(table)} shown" if count > len(table) else "all shown"
    st.markdown(f"**{plural(count, 'chunk decision')}** match in run {ctx.run_id}{scope_note} ({shown})"
                + filter_words(flt))
    if count == 0:
        st.info("No chunk decision matches these filters.")
        return
    # Each request id links to the Requests page opened on that request (a new tab: this view stays).
    table = table.assign(request_id=[request_links.link_url(ctx.run_id, int(r)) for r in table["request_id"]])
    for ns_col in ("duration_ns", "encoder_ns"):   # the forward's and the tower's time in ms, as other pages give it
        if ns_col in table:
            table.insert(table.columns.get_loc(ns_col), ns_col[:-3] + "_ms", table.pop(ns_col) / 1e6)
    tables.show_wide(table, key="chunks_table", column_config={
        "duration_ms": st.column_config.NumberColumn("duration (ms)", format="%.2f"),
        "encoder_ms": st.column_config.NumberColumn("encoder (ms)", format="%.2f"),
        "request_id": st.column_config.LinkColumn("request_id", display_text=r"request=(\d+)$",
                                                  help="opens the Requests page on this request")})
    left, right = st.columns(2)
    left.plotly_chart(charts.chunk_length_histogram(hist), key="chunks_hist", width="stretch")
    right.plotly_chart(charts.mix_share_figure(share), key="chunks_share", width="stretch")


context.run_page(render)
