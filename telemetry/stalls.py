"""Blocked spells of a run: the time between a ``stalled`` event and the next ``stall_cleared``.

The engine's ticks stop while no step is possible (engine/serve/stall_watch.py), so the events
are the only record of how long it was blocked and by what. A new ``stalled`` while one is open
means the blocker changed: the first spell ends where the second begins. A spell still open at
the end of the rows (the engine is blocked now, or stopped while blocked) ends at ``open_end_ns``.
Pure functions of rows: the dashboard (the Live timeline) and ``engine replay`` (its report) share them.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any, Iterable

from telemetry.events import EVENT_STALL_CLEARED, EVENT_STALLED

STALL_KINDS = (EVENT_STALLED, EVENT_STALL_CLEARED)
MAX_STALL_EVENTS = 2_000          # a run's newest stall events read (each is one blocker change)


@dataclass(frozen=True)
class Spell:
    start_ns: int
    end_ns: int
    blocker: str
    is_open: bool                 # not cleared by the end of the rows

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _blocker(detail: Any) -> str:
    if isinstance(detail, str):
        try:
            detail = json.loads(detail)
        except ValueError:
            return detail
    return str((detail or {}).get("blocker") or "no request can start") if isinstance(detail, dict) else "?"


def blocked_spells(rows: Iterable[tuple[int, str, Any]], open_end_ns: int | None = None) -> list[Spell]:
    """``rows``: (t_ns, kind, detail) of stall events in the order written; the spells they bound."""
    spells, start, blocker = [], None, ""
    for t_ns, kind, detail in rows:
        if start is not None and kind in STALL_KINDS:
            spells.append(Spell(int(start), int(t_ns), blocker, False))
            start = None
        if kind == EVENT_STALLED:
            start, blocker = t_ns, _blocker(detail)
    if start is not None:
        spells.append(Spell(int(start), int(max(start, open_end_ns if open_end_ns is not None else start)),
                            blocker, True))
    return spells


def read_stall_rows(conn: sqlite3.Connection, run_id: int) -> list[tuple[int, str, Any]]:
    """The run's newest ``MAX_STALL_EVENTS`` stall events, oldest first (the (run_id, kind) index)."""
    rows = conn.execute("SELECT t_ns, kind, detail FROM events WHERE run_id = ? AND kind IN (?, ?) "
                        "ORDER BY id DESC LIMIT ?", [run_id, *STALL_KINDS, MAX_STALL_EVENTS]).fetchall()
    return [tuple(r) for r in reversed(rows)]
