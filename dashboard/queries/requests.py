"""Queries behind the Requests page: status counts, a searchable request list, lifecycle events, errors."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from dashboard.queries.db import placeholders, query_df

REQUEST_COLUMNS = ("request_id", "status", "arrival_ns", "admitted_ns", "first_token_ns", "finished_ns",
                   "prompt_len", "output_len", "prefix_hit_tokens", "prefix_miss_reason", "finish_reason", "error",
                   "coalesce(source, 'workload') AS source", "first_token_rules")
MAX_LISTED = 50


class BadSearch(ValueError):
    """The search box text is not an id, a range or a list of ids."""


MAX_REQUEST_ID = 2**63 - 1        # SQLite's INTEGER: a larger id cannot exist and cannot be bound


def parse_request_id(text: str, what: str = "request id") -> int:
    """One id typed by a user: ASCII digits within SQLite's range, else BadSearch saying so."""
    if not re.fullmatch(r"[0-9]+", text):
        raise BadSearch(f"{what} {text!r} is not a number (type digits 0-9)")
    value = int(text)
    if value > MAX_REQUEST_ID:
        raise BadSearch(f"{what} {text!r} is too large (request ids are at most {MAX_REQUEST_ID})")
    return value


def parse_search(text: str) -> tuple[int, int] | list[int] | None:
    """``""`` -> None (newest), ``"12"`` / ``"3, 7"`` -> ids, ``"10-20"`` -> inclusive range."""
    text = (text or "").strip()
    if not text:
        return None
    match = re.fullmatch(r"([0-9]+)\s*-\s*([0-9]+)", text)
    if match:
        lo, hi = parse_request_id(match[1], "range start"), parse_request_id(match[2], "range end")
        if lo > hi:
            raise BadSearch(f"request range {text!r}: start {lo} is after end {hi}")
        return lo, hi
    parts = [p for p in re.split(r"[,\s]+", text) if p]
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        raise BadSearch(f"request search {text!r}: type an id (12), ids (3, 7) or a range (10-20)")
    return [parse_request_id(p) for p in parts]


def status_counts(db: Path, run_id: int) -> dict[str, int]:
    frame = query_df(db, "SELECT status, COUNT(*) AS n FROM requests WHERE run_id = ? GROUP BY status", [run_id])
    return {str(s): int(n) for s, n in zip(frame["status"], frame["n"])} if len(frame) else {}


def find_requests(db: Path, run_id: int, search: tuple[int, int] | list[int] | None,
                  statuses: tuple[str, ...] = (), limit: int = MAX_LISTED) -> pd.DataFrame:
    clauses, params = ["run_id = ?"], [run_id]
    if isinstance(search, tuple):
        clauses.append("request_id BETWEEN ? AND ?")
        params += list(search)
    elif isinstance(search, list):
        clauses.append(f"request_id IN ({placeholders(search)})")
        params += search
    if statuses:
        clauses.append(f"status IN ({placeholders(statuses)})")
        params += list(statuses)
    # A store written before images (an old bundle) has no num_images column: its requests had none.
    present = set(query_df(db, "SELECT name FROM pragma_table_info(?)", ["requests"])["name"])
    images = "num_images" if "num_images" in present else "0 AS num_images"
    cols = ", ".join(REQUEST_COLUMNS + (images,))
    return query_df(db, f"SELECT {cols} FROM requests WHERE {' AND '.join(clauses)} "
                        f"ORDER BY request_id DESC LIMIT ?", params + [int(limit)])


def lifecycle_events(db: Path, run_id: int, request_ids: list[int]) -> pd.DataFrame:
    if not request_ids:
        return pd.DataFrame(columns=["request_id", "kind", "t_ns", "detail"])
    return query_df(db, f"SELECT request_id, kind, t_ns, detail FROM request_events WHERE run_id = ? "
                        f"AND request_id IN ({placeholders(request_ids)}) ORDER BY t_ns, id",
                    [run_id, *request_ids])


def errors(db: Path, run_id: int, limit: int = 200) -> pd.DataFrame:
    """Requests in a failure state (telemetry.events.FAILURE_STATUSES): failed, ended by preemption, or
    rejected at admission. Cancelled ones are not failures (the client or the shutdown ended them)."""
    return query_df(db, "SELECT request_id, status, finished_ns / 1e6 AS at_ms, prompt_len, finish_reason, error "
                        "FROM requests WHERE run_id = ? AND status IN ('error', 'preempted', 'rejected') "
                        "ORDER BY request_id DESC LIMIT ?", [run_id, int(limit)])


def data_end_ms(db: Path, run_id: int) -> float:
    """The newest time in the run (closes spans of in-flight requests)."""
    frame = query_df(db, "SELECT t_ns + duration_ns AS t FROM ticks WHERE run_id = ? ORDER BY tick DESC LIMIT 1",
                     [run_id])
    return float(frame["t"].iloc[0]) / 1e6 if len(frame) else 0.0
