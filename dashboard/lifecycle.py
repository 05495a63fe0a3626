"""Request lifecycle phases for the waterfall: a pure function of events and request rows.

A request moves queued -> prefilling -> decoding -> an end state (finished,
error, preempted, cancelled; a rejection shows as error). A preemption that
sends a request back to the queue shows as a ``preempted`` span until it is
admitted again; in this engine a preemption ends the request (as in the
reference), so its row's end state closes the span. Lifecycle events
(``request_events``) give every step; when a request has none (an older
store), the timestamps on its ``requests`` row still give queued / prefilling
/ decoding.
"""
from __future__ import annotations

import pandas as pd

PHASE_COLUMNS = ["request_id", "phase", "start_ms", "end_ms", "detail"]
# The phase a request is in after each lifecycle event.
_NEXT_PHASE = {
    "arrived": "queued",
    "admitted": "prefilling",
    "prefill_start": "prefilling",
    "first_token": "decoding",
    "preempted": "preempted",
}
_TERMINAL = {"finished": "finished", "error": "error", "rejected": "error", "cancelled": "cancelled"}
# The end marker of a request row's status (its ``finished_ns``), when no terminal event gave one.
_END_PHASE = {**_TERMINAL, "preempted": "preempted"}


def _end_marker(req, start_ms: float) -> dict:
    phase = _END_PHASE[req.status]
    return {"request_id": req.request_id, "phase": phase, "start_ms": start_ms, "end_ms": start_ms,
            "detail": req.finish_reason if phase == "finished" else req.error}


def _finished_ms(req) -> float | None:
    ended = req.status in _END_PHASE and req.finished_ns is not None and pd.notna(req.finished_ns)
    return req.finished_ns / 1e6 if ended else None


def _phases_from_events(req, events: pd.DataFrame, end_ms: float) -> list[dict]:
    request_id = req.request_id
    rows: list[dict] = []
    phase, since = None, None
    for ev in events.itertuples(index=False):
        t_ms = ev.t_ns / 1e6
        if ev.kind in _TERMINAL:
            if phase is not None:
                rows.append({"request_id": request_id, "phase": phase, "start_ms": since, "end_ms": t_ms,
                             "detail": None})
            rows.append({"request_id": request_id, "phase": _TERMINAL[ev.kind], "start_ms": t_ms,
                         "end_ms": t_ms, "detail": ev.detail})
            return rows
        nxt = _NEXT_PHASE.get(ev.kind)
        if nxt is None or nxt == phase:
            continue
        if phase is not None:
            rows.append({"request_id": request_id, "phase": phase, "start_ms": since, "end_ms": t_ms,
                         "detail": None})
        phase, since = nxt, t_ms
    finish = _finished_ms(req)
    if phase is not None and finish is not None:  # ended without a terminal event (a preemption)
        if phase != _END_PHASE[req.status]:
            rows.append({"request_id": request_id, "phase": phase, "start_ms": since,
                         "end_ms": max(since, finish), "detail": None})
        rows.append(_end_marker(req, max(since, finish)))
    elif phase is not None:  # still in flight: the span runs to the newest data
        rows.append({"request_id": request_id, "phase": phase, "start_ms": since, "end_ms": max(since, end_ms),
                     "detail": "in progress"})
    return rows


def _phases_from_row(req, end_ms: float) -> list[dict]:
    marks = [("queued", req.arrival_ns), ("prefilling", req.admitted_ns), ("decoding", req.first_token_ns)]
    marks = [(p, t / 1e6) for p, t in marks if t is not None and pd.notna(t)]
    finish = _finished_ms(req)
    rows = []
    for i, (phase, start) in enumerate(marks):
        stop = marks[i + 1][1] if i + 1 < len(marks) else (finish if finish is not None else end_ms)
        rows.append({"request_id": req.request_id, "phase": phase, "start_ms": start, "end_ms": stop,
                     "detail": None})
    if finish is not None:
        rows.append(_end_marker(req, finish))
    return rows


def request_phases(requests: pd.DataFrame, events: pd.DataFrame, end_ms: float) -> pd.DataFrame:
    """One row per (request, phase span). ``end_ms`` closes spans of requests still running.

    ``requests`` needs request_id, status, arrival_ns, admitted_ns, first_token_ns,
    finished_ns, error, finish_reason; ``events`` needs request_id, kind, t_ns, detail.
    """
    rows: list[dict] = []
    by_request = {rid: grp.sort_values("t_ns", kind="stable") for rid, grp in events.groupby("request_id")} \
        if len(events) else {}
    for req in requests.itertuples(index=False):
        evs = by_request.get(req.request_id)
        rows += _phases_from_events(req, evs, end_ms) if evs is not None else _phases_from_row(req, end_ms)
    return pd.DataFrame(rows, columns=PHASE_COLUMNS)
