"""Pending (levers file) versus applied (lever_changes telemetry) state of every lever.

Lever state lives on disk: the file is what the dashboard asked for, the
telemetry is what the engine did about it. Nothing here is kept in the
browser session, so two browser tabs, or a restarted dashboard, agree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dashboard.queries.db import query_df
from telemetry.levers import LEVERS_BY_NAME, LeversError, defaults, read_levers_file, write_levers_file
from telemetry.schema import json_value


@dataclass(frozen=True)
class PendingFile:
    version: int | None                # None: no file yet, or the file was rejected
    overrides: dict[str, Any]          # levers the file names
    values: dict[str, Any]             # defaults with the file's overrides
    error: str | None


@dataclass(frozen=True)
class LeverRow:
    name: str
    pending: Any                       # what the file asks for; None when the file does not name it
    applied: Any                       # what the engine runs with, per telemetry
    applied_tick: int | None           # tick the engine applied it at (None: since run start)
    applied_source: str | None
    rejection: str | None              # newest rejection newer than the newest application
    state: str                         # "in sync" / "pending" / "rejected"

    @property
    def shown(self) -> Any:
        """What the widget shows: the file's request if any, else what the engine runs with."""
        return self.applied if self.pending is None else self.pending


def read_pending(path: Path) -> PendingFile:
    result = read_levers_file(path, defaults())
    if result.error is not None or result.version is None:
        return PendingFile(None, {}, defaults().as_dict(), result.error)
    raw = json.loads(Path(path).read_text())
    return PendingFile(result.version, dict(raw["levers"]), result.values.as_dict(), None)


def write_change(path: Path, name: str, value: Any, telemetry_version: int | None = None) -> int:
    """Set one lever in the levers file (atomic replace, version bumped); returns the new version.

    The new version is above both the file's and any version the engine has
    reported, so the engine never mistakes the write for an old file.
    """
    lever = LEVERS_BY_NAME.get(name)
    if lever is None:
        raise LeversError(f"unknown lever {name!r}")
    lever.check(value)
    pending = read_pending(path)
    version = max(pending.version or 0, telemetry_version or 0) + 1
    write_levers_file(path, version, {**pending.overrides, name: value})
    return version


def is_change(name: str, value: Any, shown: Any, pending: PendingFile) -> bool:
    """Whether a widget callback's value asks for something new: not what its widget was drawn with,
    nor what the file already asks for.

    Widgets are keyed by the file version, and a Streamlit rerun calls the callback of every widget of
    the previous version with the value it holds: after one toggle, every lever was written into the
    file one version at a time and the toast named the last one (issue 29, item 11)."""
    return value != shown and not (name in pending.overrides and pending.overrides[name] == value)


def reset_to_defaults(path: Path, telemetry_version: int | None = None) -> int:
    """Write every lever's default into the levers file (version bumped as ``write_change`` does).

    Every lever is named, not an empty file: the engine's base values include CHUNKSCOPE_* environment
    settings, and "defaults" means the registry's defaults."""
    pending = read_pending(path)
    version = max(pending.version or 0, telemetry_version or 0) + 1
    write_levers_file(path, version, defaults().as_dict())
    return version


def carried_over(rows: list[LeverRow]) -> dict[str, Any]:
    """Levers the run took from the levers file at its start (tick 0) and still runs with, away from
    their defaults: a levers file outlives its run, so these are often an earlier run's settings."""
    return {r.name: r.applied for r in rows
            if r.applied_tick == 0 and r.applied_source == "file" and r.applied != LEVERS_BY_NAME[r.name].default}


def latest_changes(db: Path, run_id: int) -> pd.DataFrame:
    """Newest applied and newest rejected change per lever (at most two rows per lever)."""
    return query_df(db, """
        SELECT lc.name, lc.status, lc.new, lc.tick, lc.source, lc.reason, lc.file_version, lc.id
        FROM lever_changes lc JOIN (
            SELECT name, status, MAX(id) AS id FROM lever_changes WHERE run_id = ? GROUP BY name, status
        ) newest ON newest.id = lc.id
        ORDER BY lc.name""", [run_id])


def max_file_version(changes: pd.DataFrame) -> int | None:
    versions = changes["file_version"].dropna() if len(changes) else []
    return int(max(versions)) if len(versions) else None


def lever_rows(pending: PendingFile, changes: pd.DataFrame, start_levers: dict[str, Any]) -> list[LeverRow]:
    """Join the file, the run's start values and the newest telemetry per lever."""
    rows = []
    for name, lever in LEVERS_BY_NAME.items():
        mine = changes[changes["name"] == name] if len(changes) else changes
        applied_row = mine[mine["status"] == "applied"] if len(mine) else mine
        rejected_row = mine[mine["status"] == "rejected"] if len(mine) else mine
        applied = start_levers.get(name, lever.default)
        tick = source = None
        applied_id = -1
        if len(applied_row):
            r = applied_row.iloc[0]
            applied, tick, source, applied_id = json_value(r["new"]), int(r["tick"]), r["source"], int(r["id"])
        rejection = None
        if len(rejected_row) and int(rejected_row.iloc[0]["id"]) > applied_id:
            r = rejected_row.iloc[0]
            rejection = f"{r['reason']} (tick {int(r['tick'])}, file version {r['file_version']})"
        want = pending.overrides.get(name)
        if want is None or want == applied:
            state = "in sync"
        else:
            state = "rejected" if rejection else "pending"
        rows.append(LeverRow(name, want, applied, tick, source, rejection, state))
    return rows


def rows_table(rows: list[LeverRow]) -> pd.DataFrame:
    """The lever rows for a table: ticks as integers, nothing shown as the text "None"."""
    def text(value: Any) -> str:
        return "" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return pd.DataFrame({
        "lever": [r.name for r in rows], "state": [r.state for r in rows],
        "pending": [text(r.pending) for r in rows], "applied": [text(r.applied) for r in rows],
        "applied at tick": pd.array([r.applied_tick for r in rows], dtype="Int64"),
        "source": [r.applied_source or "run start" for r in rows],
        "rejection": [r.rejection or "" for r in rows]})
