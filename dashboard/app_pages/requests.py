"""Requests: lifecycle waterfall per request (searchable), prefix-cache hits, errors with messages."""
from __future__ import annotations

import streamlit as st

from dashboard import context, request_links
from dashboard.words import plural
from dashboard.figures import charts
from dashboard.queries import data
from dashboard.panels import grammar as grammar_panel
from dashboard.panels import tables
from dashboard.context import RunContext
from dashboard.lifecycle import request_phases
from dashboard.queries.requests import MAX_LISTED, SOURCES, BadSearch, parse_search
from telemetry import events as ev

STATUSES = ev.REQUEST_STATUSES
LINK_KEY = "requests_linked_request"   # the linked request already put in the search box

# What a user looks a request up for first (latency, how it ended, its first-token rules and grammar),
# then where it came from, the prompt, its images and its prefix-cache story: the long miss reason last
# but the error. Up to grammar fits a 1280 px window (issue 29, item 5).
TABLE_COLUMNS = ["request_id", "status", "ttft_ms", "e2e_ms", "finish_reason", "first_token_rules", "grammar",
                 "source", "prompt_len", "num_images", "output_len", "prefix_hit_tokens", "prefix_hit_ratio",
                 "prefix_miss_reason", "error"]

st.title("Requests")


def follow_link() -> None:
    """``?request=12`` (a click on the Live timeline, a Chunks link) fills the search once per link,
    so the user can edit the search afterwards."""
    request_id = request_links.linked_value(st.query_params, request_links.REQUEST_PARAM)
    if request_id is None or st.session_state.get(LINK_KEY) == request_id:
        return
    st.session_state[LINK_KEY] = request_id
    st.session_state["requests_search"] = str(request_id)
    st.session_state["requests_status"] = []
    st.session_state["requests_source"] = []


def render(ctx: RunContext) -> None:
    follow_link()
    cols = st.columns([2, 3, 2])
    text = cols[0].text_input("search request ids", key="requests_search", placeholder="12 · 3, 7 · 10-20 · chatcmpl-…",
                              help="ids, ranges, or the id the API returned (chatcmpl-…-12: the engine's "
                                   "request id is its suffix, also in the x-chunkscope-request-ids header)")
    statuses = cols[1].multiselect("status", STATUSES, key="requests_status")
    sources = cols[2].multiselect("source", SOURCES, key="requests_source",
                                  help="api: sent to the OpenAI-compatible API; workload: the built-in generator "
                                       "or a trace; replay: a recorded workload served again (--workload bundle:PATH)")
    try:
        search = parse_search(text)
    except BadSearch as exc:
        st.error(str(exc))
        return
    counts, found, events, end_ms, errors = data.request_view(ctx.db, ctx.run_id, ctx.version, search,
                                                             tuple(statuses), tuple(sources))
    total = sum(counts.values())
    st.markdown(f"**{total} requests** in run {ctx.run_id}: " +
                (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none yet"))
    if found.empty:
        st.info("No request matches this search.")
    else:
        st.caption(f"{plural(len(found), 'request')} shown (newest first, at most {MAX_LISTED})")
        phases = request_phases(found, events, end_ms)
        st.plotly_chart(charts.waterfall_figure(phases), key="requests_waterfall", width="stretch")
        table = found.assign(
            ttft_ms=(found["first_token_ns"] - found["arrival_ns"]) / 1e6,
            e2e_ms=(found["finished_ns"] - found["arrival_ns"]) / 1e6,
            prefix_hit_ratio=(found["prefix_hit_tokens"] / found["prompt_len"].where(found["prompt_len"] > 0)),
            grammar=grammar_marks(found),
        )[TABLE_COLUMNS]
        tables.show_wide(table, key="requests_table", column_config={
            "request_id": st.column_config.NumberColumn("request"),
            "finish_reason": st.column_config.TextColumn("finish"),
            "ttft_ms": st.column_config.NumberColumn("TTFT (ms)", format="%.1f"),
            "e2e_ms": st.column_config.NumberColumn("e2e (ms)", format="%.1f"),
            "prefix_hit_ratio": st.column_config.NumberColumn("prefix hit", format="percent"),
            "prefix_hit_tokens": st.column_config.NumberColumn("hit tokens"),
            "num_images": st.column_config.NumberColumn("images"),
            "prefix_miss_reason": st.column_config.TextColumn("prefix miss reason")})
    grammar_panel.render(ctx)
    st.subheader(f"Errors and rejections ({len(errors)})")
    if errors.empty:
        st.success("No request ended with an error.")
    else:
        tables.show(errors, key="requests_errors")


def grammar_marks(found):
    """'json_schema ✓' / 'regex ✗' / 'choice …' (in flight) per row, then '✂' when max_tokens cut the
    output before its grammar ended and '≈ keywords' when a lenient compile ignored schema keywords;
    empty for requests without a grammar."""
    if "grammar_kind" not in found:
        return ""
    reasons = found["finish_reason"] if "finish_reason" in found else [None] * len(found)
    ignored = found["grammar_approximations"] if "grammar_approximations" in found else [None] * len(found)
    return [mark(kind, valid, reason, approx)
            for kind, valid, reason, approx in zip(found["grammar_kind"], found["grammar_valid"], reasons, ignored)]


def mark(kind, valid, finish_reason=None, approximations=None) -> str:
    if not isinstance(kind, str) or not kind:
        return ""
    valid = None if valid is None or valid != valid else int(valid)
    text = kind + {1: " ✓", 0: " ✗"}.get(valid, " …")
    if valid == 0 and finish_reason == "length":
        text += " ✂"
    if isinstance(approximations, str) and approximations:
        text += " ≈ " + approximations.replace(",", ", ")
    return text


context.run_page(render)
