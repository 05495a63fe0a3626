"""Cached read-only queries: the only way pages reach the telemetry store.

Every cached function takes ``version``, the run's committed event count
plus its status (``run_version``): while a run is live the version moves on
every writer flush and the caches refresh; a finished run's version never
changes, so its heavy whole-run aggregates are computed once.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import lever_state
from dashboard.figures import charts
from dashboard.queries import api as queries_api
from dashboard.queries import chunks as queries_chunks
from dashboard.queries import grammar as queries_grammar
from dashboard.queries import live as queries_live
from dashboard.queries import prefix as queries_prefix
from dashboard.queries import requests as queries_requests
from dashboard.queries import runs as queries_runs
from dashboard.queries import spec as queries_spec
from dashboard.queries.db import DataUnavailable, query_one
from dashboard.queries.chunks import ChunkFilter

_ENTRIES = 64
Version = tuple  # (num_events, status)


@st.cache_data(ttl=0.5, max_entries=_ENTRIES, show_spinner=False)
def list_runs(db: str) -> pd.DataFrame:
    return queries_runs.list_runs(Path(db))


def run_version(db: str, run_id: int) -> Version:
    """Cheap primary-key lookup, deliberately uncached: it is the cache key of everything else."""
    row = query_one(Path(db), "SELECT num_events, status FROM runs WHERE run_id = ?", [run_id])
    if row is None:
        raise DataUnavailable(f"run {run_id} is not in {db}", level="info")
    return row["num_events"], row["status"]


def timeline_version(db: str, run_id: int, version: Version) -> Version:
    """The cache key of the Live timeline. A live run's moves with the newest row of each table the
    timeline draws (``MAX(id)``: one primary-key lookup each; the one engine writing this store
    writes the newest rows), not with every event as ``run_version`` does: it holds still while only
    requests arrive, as they do at a blocked engine, so a blocked refresh neither queries the window
    nor rebuilds the figure. (KV-quant and rank events are written with their tick's rows.)
    A finished run's key is its fixed ``version``."""
    if version[1] != "running":
        return version
    row = query_one(Path(db), "SELECT (SELECT MAX(id) FROM ticks) AS ticks, "
                              "(SELECT MAX(id) FROM stream_events) AS streams, "
                              "(SELECT MAX(id) FROM preemptions) AS preemptions, "
                              "(SELECT MAX(id) FROM lever_changes) AS levers, "
                              "(SELECT MAX(id) FROM events) AS events") or {}   # a stall starts or clears
    return (run_id, row.get("ticks"), row.get("streams"), row.get("preemptions"), row.get("levers"),
            row.get("events"))


def run_row(db: str, run_id: int, version: Version) -> dict | None:
    """The run's row with its status as of now: the cached row's ``version`` holds still once a killed
    engine stops writing ("running" in the store), so whether its process lives is asked on every call."""
    row = _run_row(db, run_id, version)
    if row is None:
        return None
    return {**row, "status": queries_runs.shown_status(version[1], row["pid"], row["hostname"])}


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def _run_row(db: str, run_id: int, version: Version) -> dict | None:
    return queries_runs.run_row(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def live_counters(db: str, run_id: int, version: Version, window_s: float) -> dict | None:
    last = queries_live.latest_tick(Path(db), run_id)
    if last is None:
        return None
    end_ns = int(last["t_ns"] + last["duration_ns"])
    return {**last, **queries_live.throughput(Path(db), run_id, end_ns, window_s)}


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def timeline_window(db: str, run_id: int, version: Version, window_s: float, open_end_ms: float | None = None):
    return queries_live.timeline_window(Path(db), run_id, window_s, open_end_ms)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def timeline_spec(db: str, run_id: int, version: Version, window_s: float, open_end_ms: float | None = None) -> str:
    """The Live timeline's figure as Plotly JSON, cached like the rows it is drawn from.

    Building and serializing it is most of a Live refresh's CPU (about 0.5 s on a loaded
    2-core box); while nothing new arrives (a blocked or idle engine, a finished run) the
    version holds and a refresh costs a lookup, which leaves the page free to name a stall.
    ``open_end_ms``: while the engine is blocked, now (in coarse steps), where the open stall ends.
    """
    win = timeline_window(db, run_id, version, window_s, open_end_ms)
    cap = queries_live.MAX_STREAM_EVENTS if win.stream_events_capped else None
    return charts.timeline_json(win.forwards, win.stream_events, win.links, win.preemptions, win.lever_changes,
                                (win.start_ms, win.end_ms), stream_events_cap=cap,
                                kv_quant_changes=win.kv_quant_changes, rank_forwards=win.rank_forwards,
                                encoder=win.encoder,
                                stalls=win.stalls)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def kv_quant_status(db: str, run_id: int, version: Version) -> dict | None:
    return queries_live.kv_quant_status(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def api_activity(db: str, run_id: int, version: Version, end_ns: int, window_s: float) -> dict:
    return queries_api.api_activity(Path(db), run_id, end_ns, window_s)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def latency_percentiles(db: str, run_id: int, version: Version) -> pd.DataFrame:
    return queries_live.latency_percentiles(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def chunk_scope(db: str, run_id: int, version: Version) -> tuple[int | None, int]:
    return queries_chunks.scope_start(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def chunk_view(db: str, run_id: int, version: Version, flt: ChunkFilter, limit: int):
    """(matching count, newest rows, length histogram, mix share) for one filter."""
    path = Path(db)
    return (queries_chunks.chunk_count(path, run_id, flt), queries_chunks.chunk_table(path, run_id, flt, limit),
            queries_chunks.length_histogram(path, run_id, flt), queries_chunks.mix_share(path, run_id, flt))


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def request_view(db: str, run_id: int, version: Version, search, statuses: tuple[str, ...],
                 sources: tuple[str, ...] = ()):
    """(status counts, matching requests, their lifecycle events, newest data time, errors)."""
    path = Path(db)
    found = queries_requests.find_requests(path, run_id, search, statuses, sources=sources)
    ids = [int(x) for x in found["request_id"]] if len(found) else []
    if ids:   # grammar marks: their own query, so a store without grammar columns still lists requests
        found = found.merge(queries_grammar.marks(path, run_id, ids), on="request_id", how="left")
    return (queries_requests.status_counts(path, run_id), found,
            queries_requests.lifecycle_events(path, run_id, ids),
            queries_requests.data_end_ms(path, run_id), queries_requests.errors(path, run_id))


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def levers_in_effect(db: str, run_id: int, version: Version, start: dict) -> tuple[dict, dict[str, str]]:
    """The run's lever values at its first tick, and the changes after it (text per lever)."""
    return queries_runs.levers_in_effect(start, queries_runs.applied_lever_changes(Path(db), run_id))


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def lever_changes(db: str, run_id: int, version: Version) -> pd.DataFrame:
    return lever_state.latest_changes(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def run_metrics(db: str, run_id: int, version: Version) -> dict:
    return queries_runs.run_metrics(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def roofline_by_path(db: str, run_id: int, version: Version) -> pd.DataFrame:
    return queries_runs.roofline_by_path(Path(db), run_id)


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def prefix_view(db: str, run_id: int, version: Version):
    """(scope, hit ratio buckets, totals, miss reasons, snapshot event counts) over the newest requests."""
    path = Path(db)
    scope = queries_prefix.recent_scope(path, run_id)
    return (scope, queries_prefix.hit_ratio_over_time(path, run_id, scope=scope),
            queries_prefix.totals(path, run_id, scope), queries_prefix.miss_reasons(path, run_id, scope),
            queries_prefix.snapshot_counts(path, run_id, scope))


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def spec_view(db: str, run_id: int, version: Version, window_s: float):
    """(totals by kind, acceptance buckets, steps in the window, drops in the window, (start ms, end ms)),
    "none" for a run without speculation, or None before the first tick."""
    path = Path(db)
    last = queries_live.latest_tick(path, run_id)
    if last is None:
        return None
    if not queries_spec.has_speculation(path, run_id):  # the usual run: two index probes, nothing more
        return "none"
    end_ns = int(last["t_ns"] + last["duration_ns"])
    start_ns = max(0, end_ns - int(window_s * 1e9))
    first_tick = queries_spec.first_tick_since(path, run_id, start_ns)
    return (queries_spec.totals_by_kind(path, run_id), queries_spec.acceptance_over_time(path, run_id),
            queries_spec.steps_since(path, run_id, first_tick), queries_spec.drops_since(path, run_id, first_tick),
            (start_ns / 1e6, end_ns / 1e6))


@st.cache_data(max_entries=_ENTRIES, show_spinner=False)
def grammar_summary(db: str, run_id: int, version: Version) -> dict | None:
    return queries_grammar.summary(Path(db), run_id)
