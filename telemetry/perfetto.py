"""One run of a telemetry snapshot as Chrome trace JSON (opens in Perfetto / chrome://tracing).

Layout, all in process ``chunkscope run N`` (timestamps in microseconds):
- thread tracks ``scheduler``, ``default``, ``prefill``, ``secondary`` (``M`` thread_name);
- ``X`` slices: each tick on ``scheduler`` (named by its path), each prefill
  chunk forward on ``prefill``, each decode-only forward on ``default``. Rows
  of one track come from one sequential loop, so a slice that runs past the
  next one's start is clamped to it (args ``clamped_from_us``): the slices of
  a track never partially overlap;
- zero-length ``X`` slices for stream-event records, waits and syncs; a record
  and the wait on it are joined by a flow arrow (``bind_id`` with
  ``flow_out`` / ``flow_in``), written only when both ends are in the snapshot;
- async ``b``/``e`` slices (category ``request``, id = request id) for each
  request's lifetime, with nested ``queued`` / ``prefill`` / ``decode`` phases;
  a request still open at the end of the snapshot closes at its last time;
- ``C`` counters ``requests`` (waiting, prefilling, active) and ``kv blocks``
  (used, total) per tick; instant ``i`` events for preemptions and lever changes.

Rows are read with cursors and written straight into the gzip file, so a long
run never sits in memory.
"""
from __future__ import annotations

import gzip
import io
import json
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Iterator

from telemetry.ro_uri import read_only_uri

PID = 1
TRACKS = {"scheduler": 1, "default": 2, "prefill": 3, "secondary": 4}


def _us(t_ns: int | float) -> float:
    return round(t_ns / 1000.0, 3)


class _TraceWriter:
    """Writes ``{"traceEvents": [...], ...}`` one event at a time."""

    def __init__(self, handle: io.TextIOBase) -> None:
        self._handle = handle
        self._is_first = True
        self.num_events = 0
        handle.write('{"displayTimeUnit":"ms","traceEvents":[\n')

    def emit(self, event: dict[str, Any]) -> None:
        if not self._is_first:
            self._handle.write(",\n")
        self._handle.write(json.dumps(event, separators=(",", ":"), default=str))
        self._is_first = False
        self.num_events += 1

    def close(self, metadata: dict[str, Any]) -> None:
        self._handle.write('\n],"metadata":' + json.dumps(metadata, default=str) + "}\n")


def _clamped(slices: Iterable[tuple[int, int, dict[str, Any]]]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(start_ns, dur_ns, event) sorted by start -> the same with each end cut at the next start."""
    pending = None
    for start, dur, event in slices:
        if pending is not None:
            yield _cut(pending, start)
        pending = (start, max(0, dur), event)
    if pending is not None:
        yield pending


def _cut(item: tuple[int, int, dict[str, Any]], next_start: int) -> tuple[int, int, dict[str, Any]]:
    start, dur, event = item
    if start + dur > next_start:
        event.setdefault("args", {})["clamped_from_us"] = _us(dur)
        dur = max(0, next_start - start)
    return start, dur, event


def _emit_slices(out: _TraceWriter, track: str, rows: Iterable[tuple[int, int, dict[str, Any]]]) -> None:
    for start, dur, event in _clamped(rows):
        out.emit({"ph": "X", "pid": PID, "tid": TRACKS[track], "ts": _us(start),
                  "dur": round(_us(start + dur) - _us(start), 3), **event})


def _rows(conn: sqlite3.Connection, sql: str, params: Any = ()) -> Iterator[sqlite3.Row]:
    return conn.execute(sql, params)


def _tick_slices(conn: sqlite3.Connection, run_id: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    for r in _rows(conn, "SELECT * FROM ticks WHERE run_id = ? ORDER BY t_ns, id", [run_id]):
        yield r["t_ns"], r["duration_ns"], {"name": r["path"], "cat": "tick", "args": {
            "tick": r["tick"], "prefill_tokens": r["num_prefill_tokens"], "decode_tokens": r["num_decode_tokens"],
            "active": r["num_active"], "waiting": r["num_waiting"], "kv_blocks_used": r["kv_blocks_used"]}}


def _chunk_slices(conn: sqlite3.Connection, run_id: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    for r in _rows(conn, "SELECT * FROM chunks WHERE run_id = ? ORDER BY t_ns, id", [run_id]):
        yield r["t_ns"], r["duration_ns"], {"name": f"{r['path']} chunk r{r['request_id']}", "cat": "forward",
                                            "args": {k: r[k] for k in (
                                                "tick", "request_id", "offset", "length", "prompt_len", "is_last",
                                                "cap_rule", "can_mix", "mix_blocker", "decode_width", "outcome")}}


def _decode_slices(conn: sqlite3.Connection, run_id: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    for r in _rows(conn, "SELECT * FROM ticks WHERE run_id = ? AND path = 'decode' ORDER BY t_ns, id", [run_id]):
        yield r["t_ns"], r["duration_ns"], {"name": f"decode x{r['num_decode_tokens']}", "cat": "forward",
                                            "args": {"tick": r["tick"], "width": r["num_decode_tokens"]}}


_STREAM_SQL = """
SELECT s.*,
  CASE WHEN s.kind = 'record' THEN EXISTS(SELECT 1 FROM stream_events w WHERE w.run_id = :run AND w.kind = 'wait'
       AND w.seq = s.seq AND w.event_name = s.event_name) END AS has_wait,
  CASE WHEN s.kind = 'wait' THEN EXISTS(SELECT 1 FROM stream_events r WHERE r.run_id = :run AND r.kind = 'record'
       AND r.seq = s.seq AND r.event_name = s.event_name) END AS has_record
FROM stream_events s WHERE s.run_id = :run ORDER BY s.t_ns, s.id
"""


def _stream_events(out: _TraceWriter, conn: sqlite3.Connection, run_id: int) -> None:
    for r in _rows(conn, _STREAM_SQL, {"run": run_id}):
        track = (r["target_stream"] or r["stream"]) if r["kind"] == "wait" else r["stream"]
        event = {"ph": "X", "pid": PID, "tid": TRACKS.get(track, TRACKS["default"]), "ts": _us(r["t_ns"]),
                 "dur": 0, "name": f"{r['kind']} {r['event_name']} #{r['seq']}", "cat": "stream",
                 "args": {"tick": r["tick"], "stream": r["stream"], "target_stream": r["target_stream"],
                          "seq": r["seq"], "gpu_elapsed_ms": r["gpu_elapsed_ms"]}}
        if r["has_wait"]:
            event.update(bind_id=f"{r['event_name']}#{r['seq']}", flow_out=True)
        elif r["has_record"]:
            event.update(bind_id=f"{r['event_name']}#{r['seq']}", flow_in=True)
        out.emit(event)


def _request_phases(r: sqlite3.Row, end_of_data_ns: int) -> tuple[int, int, list[tuple[str, int, int]]]:
    """Lifetime [start, end] and its phases, each clamped inside it and in time order."""
    start = r["arrival_ns"] if r["arrival_ns"] is not None else r["t_ns"]
    end = r["finished_ns"] if r["finished_ns"] is not None else max(end_of_data_ns, start)
    end = max(end, start)
    marks = [start]
    for value in (r["admitted_ns"], r["first_token_ns"]):
        marks.append(min(max(value if value is not None else end, marks[-1]), end))
    marks.append(end)
    names = ("queued", "prefill", "decode")
    return start, end, [(n, a, b) for n, a, b in zip(names, marks, marks[1:]) if b > a]


def _requests(out: _TraceWriter, conn: sqlite3.Connection, run_id: int, end_of_data_ns: int) -> None:
    for r in _rows(conn, "SELECT * FROM requests WHERE run_id = ? ORDER BY coalesce(arrival_ns, t_ns), request_id", [run_id]):
        start, end, phases = _request_phases(r, end_of_data_ns)
        common = {"pid": PID, "tid": TRACKS["scheduler"], "cat": "request", "id": str(r["request_id"])}
        out.emit({"ph": "b", "ts": _us(start), "name": f"request {r['request_id']}", **common,
                  "args": {"status": r["status"], "prompt_len": r["prompt_len"], "output_len": r["output_len"],
                           "finish_reason": r["finish_reason"], "error": r["error"],
                           "is_open": r["finished_ns"] is None}})
        for name, a, b in phases:
            out.emit({"ph": "b", "ts": _us(a), "name": name, **common})
            out.emit({"ph": "e", "ts": _us(b), "name": name, **common})
        out.emit({"ph": "e", "ts": _us(end), "name": f"request {r['request_id']}", **common})


def _counters(out: _TraceWriter, conn: sqlite3.Connection, run_id: int) -> None:
    for r in _rows(conn, "SELECT * FROM ticks WHERE run_id = ? ORDER BY t_ns, id", [run_id]):
        ts = _us(r["t_ns"])
        out.emit({"ph": "C", "pid": PID, "ts": ts, "name": "requests",
                  "args": {"waiting": r["num_waiting"], "prefilling": r["num_prefilling"], "active": r["num_active"]}})
        out.emit({"ph": "C", "pid": PID, "ts": ts, "name": "kv blocks",
                  "args": {"used": r["kv_blocks_used"], "total": r["kv_blocks_total"]}})


def _instants(out: _TraceWriter, conn: sqlite3.Connection, run_id: int) -> None:
    for r in _rows(conn, "SELECT * FROM preemptions WHERE run_id = ? ORDER BY t_ns, id", [run_id]):
        out.emit({"ph": "i", "s": "t", "pid": PID, "tid": TRACKS["scheduler"], "ts": _us(r["t_ns"]),
                  "name": f"preempt r{r['victim_request_id']}", "cat": "preemption",
                  "args": {k: r[k] for k in ("tick", "victim_request_id", "blocks_freed", "reason", "policy",
                                             "prefill_request_id", "num_remaining")}})
    for r in _rows(conn, "SELECT * FROM lever_changes WHERE run_id = ? ORDER BY t_ns, id", [run_id]):
        out.emit({"ph": "i", "s": "p", "pid": PID, "tid": TRACKS["scheduler"], "ts": _us(r["t_ns"]),
                  "name": f"lever {r['name']} {r['status']}", "cat": "lever",
                  "args": {k: r[k] for k in ("tick", "name", "old", "new", "source", "status", "reason")}})


def write_trace(db_path: str | Path, out_path: str | Path, run_id: int) -> int:
    """Convert run ``run_id`` of a (snapshot) database to gzipped Chrome trace JSON; returns the event count."""
    conn = sqlite3.connect(read_only_uri(Path(db_path)), uri=True)
    conn.row_factory = sqlite3.Row
    try:
        end_of_data = conn.execute("SELECT max(t) FROM (SELECT max(t_ns + duration_ns) AS t FROM ticks WHERE "
                                   "run_id = :run UNION ALL SELECT max(t_ns) FROM tokens WHERE run_id = :run "
                                   "UNION ALL SELECT max(t_ns) FROM requests WHERE run_id = :run)",
                                   {"run": run_id}).fetchone()[0] or 0
        with gzip.open(out_path, "wt", encoding="utf-8", compresslevel=6) as handle:
            out = _TraceWriter(handle)
            out.emit({"ph": "M", "pid": PID, "name": "process_name", "args": {"name": f"chunkscope run {run_id}"}})
            for name, tid in TRACKS.items():
                out.emit({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": name}})
                out.emit({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
            _emit_slices(out, "scheduler", _tick_slices(conn, run_id))
            _emit_slices(out, "prefill", _chunk_slices(conn, run_id))
            _emit_slices(out, "default", _decode_slices(conn, run_id))
            _stream_events(out, conn, run_id)
            _requests(out, conn, run_id, end_of_data)
            _counters(out, conn, run_id)
            _instants(out, conn, run_id)
            out.close({"run_id": run_id, "source": "chunkscope telemetry"})
        return out.num_events
    finally:
        conn.close()
