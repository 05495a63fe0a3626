"""Queries behind the Requests page: status counts, a searchable request list, lifecycle events, errors.

What the search box accepts is ``dashboard/queries/ids.py``'s grammar (also the Chunks page's)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from dashboard.queries.db import placeholders, query_df
from dashboard.queries.ids import BadSearch, IdSelection, parse_ids  # noqa: F401  (BadSearch: the page catches it)

REQUEST_COLUMNS = ("request_id", "status", "arrival_ns", "admitted_ns", "first_token_ns", "finished_ns",
                   "prompt_len", "output_len", "prefix_hit_tokens", "prefix_miss_reason", "finish_reason", "error",
                   "coalesce(source, 'workload') AS source", "first_token_rules")
MAX_LISTED = 50


SOURCES = ("api", "workload", "replay")   # where a request came from (requests.source; NULL = workload)


def parse_search(text: str) -> IdSelection | None:
    """The Requests search box: ``dashboard/queries/ids.py``'s grammar (ids, ranges, API ids)."""
    return parse_ids(text)


def status_counts(db: Path, run_id: int) -> dict[str, int]:
    frame = query_df(db, "SELECT status, COUNT(*) AS n FROM requests WHERE run_id = ? GROUP BY status", [run_id])
    return {str(s): int(n) for s, n in zip(frame["status"], frame["n"])} if len(frame) else {}


def find_requests(db: Path, run_id: int, search: IdSelection | None,
                  statuses: tuple[str, ...] = (), limit: int = MAX_LISTED,
                  sources: tuple[str, ...] = ()) -> pd.DataFrame:
    clauses, params = ["run_id = ?"], [run_id]
    if search is not None:
        where, values = search.where("request_id")
        clauses.append(where)
        params += values
    if sources:
        clauses.append(f"coalesce(source, 'workload') IN ({placeholders(sources)})")
        params += list(sources)
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
