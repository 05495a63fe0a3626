"""A recorded run read back from a telemetry store: what a replay re-runs and compares against.

Everything a replay needs is in one run's rows: the engine config, seed and
checkpoint hash (``runs``), the workload with arrival ticks and sampling
seeds (``requests``), the lever timeline (``lever_changes``), and the
outputs to compare with (``chunks``, ``ticks``, ``tokens``, final request
statuses). A bundle's ``telemetry.db`` is such a store, so the same reader
serves ``replay bundle.zip`` and ``replay run_dir/telemetry.db``.

No torch here: this module only reads SQLite.
"""
from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from telemetry import events as ev
from telemetry.schema import decode_row
from telemetry.stalls import Spell, blocked_spells, read_stall_rows

# Statuses a request still has when its run ended under it (crash, SIGTERM).
IN_FLIGHT = (ev.REQ_WAITING, ev.REQ_PREFILLING, ev.REQ_DECODING)
CANCELLED_PREFIX = "cancelled:"   # how stores written before the ``cancelled`` status marked it


class ReplayInputError(ValueError):
    """A bundle or store that cannot be replayed; the message names the file and the reason."""


@dataclass
class RecordedRun:
    run_id: int
    status: str                               # running / finished / crashed
    model: str                                # "tiny" or the checkpoint directory name
    config: dict[str, Any]                    # kv_blocks, ssm_slots, seed, device, dtype
    start_levers: dict[str, Any]              # values in force at tick 0
    checkpoint_hash: str
    requests: list[ev.RequestRecord]          # final row per request, in submission order
    lever_changes: list[ev.LeverChange]       # applied changes, in (tick, id) order
    chunks: list[ev.ChunkDecision]
    ticks: list[ev.Tick]
    tokens: list[ev.TokenEvent]
    stalls: list[Spell] = field(default_factory=list)   # blocked spells (telemetry/stalls.py)
    source: str = ""                          # the file this came from (for messages)
    images: dict[str, bytes] = field(default_factory=dict)   # content hash -> bytes of the requests' images
    notes: list[str] = field(default_factory=list)

    @property
    def num_ticks(self) -> int:
        """Ticks the run executed: a replay of the same run stops after as many."""
        return self.ticks[-1].tick + 1 if self.ticks else 0

    def output_tokens(self) -> dict[int, list[int]]:
        """request_id -> generated tokens; the per-token rows win over the request row,
        which a crash can leave a few tokens behind."""
        by_request: dict[int, list[int]] = {r.request_id: list(r.output_tokens) for r in self.requests}
        from_rows: dict[int, list[tuple[int, int]]] = {}
        for token in self.tokens:
            from_rows.setdefault(token.request_id, []).append((token.index, token.token_id))
        for request_id, pairs in from_rows.items():
            pairs.sort()
            by_request[request_id] = [t for _, t in pairs]
        return by_request


def is_cut_short(status: str | None, error: str | None) -> bool:
    """True when the run ended before the request could (crash, SIGTERM, replay cut)."""
    return status in IN_FLIGHT or status == ev.REQ_CANCELLED or bool(error and error.startswith(CANCELLED_PREFIX))


def _connect(db_path: str) -> sqlite3.Connection:
    if not os.path.isfile(db_path):
        raise ReplayInputError(f"{db_path}: no such telemetry store")
    uri = "file:" + urllib.parse.quote(os.path.abspath(db_path)) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5)
        conn.row_factory = sqlite3.Row
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        raise ReplayInputError(f"{db_path}: not a readable telemetry store ({exc})") from None
    return conn


def _rows(conn: sqlite3.Connection, cls: type, run_id: int, order: str) -> list[Any]:
    cursor = conn.execute(f"SELECT * FROM [{cls.TABLE}] WHERE run_id = ? ORDER BY {order}", (run_id,))
    return [decode_row(cls, dict(row)) for row in cursor]


def load_recorded_run(db_path: str | os.PathLike, run_id: int | None = None) -> RecordedRun:
    """Read run ``run_id`` (default: the latest) of the store at ``db_path``."""
    db_path = os.fspath(db_path)
    conn = _connect(db_path)
    try:
        try:
            if run_id is None:
                found = conn.execute("SELECT max(run_id) FROM runs").fetchone()[0]
                if found is None:
                    raise ReplayInputError(f"{db_path}: holds no run")
                run_id = int(found)
            run = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if run is None:
                raise ReplayInputError(f"{db_path}: no run {run_id}")
            run = dict(run)
            schema_version = run.get("schema_version") or 1
            if schema_version > ev.SCHEMA_VERSION:
                raise ReplayInputError(f"{db_path}: telemetry schema {schema_version} is newer than this "
                                       f"engine's ({ev.SCHEMA_VERSION}); upgrade Chunkscope to replay it")
            requests = _rows(conn, ev.RequestRecord, run_id, "arrival_tick, arrival_ns, request_id")
            changes = [c for c in _rows(conn, ev.LeverChange, run_id, "tick, id") if c.status == "applied"]
            chunks = _rows(conn, ev.ChunkDecision, run_id, "tick, id")
            ticks = _rows(conn, ev.Tick, run_id, "tick, id")
            tokens = _rows(conn, ev.TokenEvent, run_id, "tick, id")
            stall_rows = read_stall_rows(conn, run_id)
        except sqlite3.DatabaseError as exc:
            raise ReplayInputError(f"{db_path}: cannot read run {run_id} ({exc})") from None
    finally:
        conn.close()
    recorded = RecordedRun(
        run_id=run_id, status=run.get("status") or "unknown", model=run.get("model") or "",
        config=_json(run.get("config")), start_levers=_json(run.get("levers")),
        checkpoint_hash=run.get("checkpoint_hash") or "", requests=requests, lever_changes=changes,
        chunks=chunks, ticks=ticks, tokens=tokens, source=db_path,
        stalls=blocked_spells(stall_rows, open_end_ns=_last_ns(ticks, changes, stall_rows)))
    _check_replayable(recorded)
    return recorded


def _last_ns(ticks: list[ev.Tick], changes: list[ev.LeverChange], stall_rows: list[tuple]) -> int:
    """The run's last recorded moment: where a spell never cleared (stopped while blocked) ends."""
    ends = [t.t_ns + t.duration_ns for t in ticks[-1:]] + [c.t_ns for c in changes] + [r[0] for r in stall_rows]
    return max(ends, default=0)


def _json(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    return json.loads(value) if value else {}


def _check_replayable(recorded: RecordedRun) -> None:
    where = f"{recorded.source} run {recorded.run_id}"
    for name in ("kv_blocks", "ssm_slots"):
        if not isinstance(recorded.config.get(name), int):
            raise ReplayInputError(f"{where}: engine config has no integer {name!r}; cannot rebuild the engine")
    missing = [r.request_id for r in recorded.requests if r.arrival_tick is None]
    if missing:
        raise ReplayInputError(f"{where}: request {missing[0]} has no arrival_tick; a replay keys arrivals by tick")
    if recorded.ticks and recorded.ticks[0].tick != 0:
        raise ReplayInputError(f"{where}: the first recorded tick is {recorded.ticks[0].tick}, not 0 "
                               f"(a windowed export?); a replay needs the run from its start")
    if recorded.status == "running":
        recorded.notes.append("the run was still running when it was captured: its last requests may be "
                              "cut short in the recording")
    elif recorded.status == "crashed":
        recorded.notes.append("the run crashed: requests in flight at the end are compared only as far as "
                              "the recording goes")
