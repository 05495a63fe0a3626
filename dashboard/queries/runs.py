"""Queries behind the Runs page and the run picker: the run list and whole-run summary metrics."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pandas as pd

from dashboard.queries.db import query_df, query_one
from dashboard.queries.live import latency_percentiles
from dashboard.queries.totals import run_totals_of
from telemetry import events as ev
from telemetry.procs import is_pid_alive
from telemetry.schema import json_value

RUN_COLUMNS = ("run_id", "started_at", "finished_at", "model", "device", "status", "pid", "hostname",
               "num_events", "num_dropped", "writer_error", "workload", "levers", "config")


def shown_status(status: str, pid, hostname) -> str:
    """A run still marked running whose process died on this host is shown as crashed."""
    if status == "running" and pid is not None and pd.notna(pid) and hostname == socket.gethostname() \
            and not is_pid_alive(int(pid)):
        return "crashed"
    return status


def list_runs(db: Path) -> pd.DataFrame:
    """Every run, newest first, with its dtype, the CPU it ran on and, for a failed run, why."""
    runs = query_df(db, f"SELECT {', '.join(RUN_COLUMNS)} FROM runs ORDER BY run_id DESC")
    if len(runs):
        runs["status"] = [shown_status(s, p, h) for s, p, h in zip(runs["status"], runs["pid"], runs["hostname"])]
    numerics = [run_numerics(config) for config in runs["config"]]
    runs["dtype"] = [n["dtype"] for n in numerics]
    runs["cpu"] = [n["cpu"] for n in numerics]
    runs["failure reason"] = [failure_reason(db, int(r)) if status == "failed" else None
                              for r, status in zip(runs["run_id"], runs["status"])]
    return runs


def run_numerics(config_json: str | None) -> dict[str, str | None]:
    """The dtype a run computed in and the CPU it ran on (model name and ISA flags), from its config;
    None for a run recorded before the engine wrote them."""
    try:
        config = json.loads(config_json) if config_json else {}
    except ValueError:
        config = {}
    cpu = " · ".join(str(config[k]) for k in ("cpu_model", "cpu_isa") if config.get(k)) or None
    return {"dtype": config.get("dtype"), "cpu": cpu}


def failure_reason(db: Path, run_id: int) -> str | None:
    """What the engine said when the run failed (its ``run_failed`` event), if it said anything."""
    row = query_one(db, "SELECT detail FROM events WHERE run_id = ? AND kind = ? ORDER BY id DESC LIMIT 1",
                    [run_id, ev.EVENT_RUN_FAILED])
    detail = json_value(row["detail"]) if row else None
    return detail.get("reason") if isinstance(detail, dict) else None


def run_row(db: Path, run_id: int) -> dict | None:
    # + the command line: the start form restarts a crashed run with its API options
    row = query_one(db, f"SELECT {', '.join(RUN_COLUMNS)}, command_line FROM runs WHERE run_id = ?", [run_id])
    if row is not None:
        row["status"] = shown_status(row["status"], row["pid"], row["hostname"])
        for key in ("workload", "levers", "config"):
            try:
                row[key] = json.loads(row[key]) if row[key] else {}
            except ValueError:
                row[key] = {}
    return row


def end_states(totals: dict) -> dict[str, int]:
    """Each end state on its own (``run_totals`` keeps ``num_<status>_requests`` per end state), the
    requests not ended yet, and ``errors``: the failure states together (error + preempted + rejected)."""
    counts = {status: totals[f"num_{status}_requests"] or 0 for status in ev.END_STATUSES}
    counts["running"] = totals["num_running_requests"] or 0
    counts["errors"] = sum(counts[status] for status in ev.FAILURE_STATUSES)
    return counts


def run_metrics(db: Path, run_id: int) -> dict:
    """Whole-run numbers for the comparison table.

    Counts and sums come from the writer's running totals (one row read), latency from a
    bounded sample (``latency_percentiles(is_recent=False)``). So a cold render costs about the
    same at minute 1 and minute 30 of a run.
    """
    totals = run_totals_of(db, run_id)
    duration_s = (totals["last_tick_end_ns"] or 0) / 1e9
    latency = latency_percentiles(db, run_id, is_recent=False).set_index("metric")
    metrics = {
        "duration_s": duration_s,
        "requests": totals["num_requests"], **end_states(totals),
        "decode_tok_s": totals["num_decode_tokens"] / duration_s if duration_s else None,
        "prefill_tok_s": totals["num_prefill_tokens"] / duration_s if duration_s else None,
        "preemptions": totals["num_preemptions"],
        "mixed_share": totals["num_mixed_chunks"] / totals["num_chunks"] if totals["num_chunks"] else None,
        "prefix_hit_ratio": (totals["num_prefix_hit_tokens"] / totals["num_prompt_tokens"]
                             if totals["num_prompt_tokens"] else None),
        "latency scope": latency["scope"].iloc[0],
    }
    for metric in ("TTFT", "ITL", "e2e"):
        for pct in ("p50", "p90", "p99"):
            value = latency.loc[metric, f"{pct}_ms"]
            metrics[f"{metric} {pct} ms"] = None if value is None or pd.isna(value) else float(value)
    return metrics


def applied_lever_changes(db: Path, run_id: int, limit: int = 2000) -> list[dict]:
    """The run's applied lever changes in the order the engine applied them."""
    frame = query_df(db, "SELECT name, new, tick, source FROM lever_changes WHERE run_id = ? AND status = 'applied' "
                         "ORDER BY id LIMIT ?", [run_id, int(limit)])
    return frame.to_dict("records")


def levers_in_effect(start: dict, changes: list[dict]) -> tuple[dict, dict[str, str]]:
    """(values at the first tick, later changes per lever as text).

    The run row holds defaults + environment; a levers file present at start is applied at
    tick 0, before the first forward, so those changes belong to the starting values.
    """
    first = dict(start)
    later: dict[str, list[str]] = {}
    for change in changes:
        value = json_value(change["new"])
        if int(change["tick"] or 0) == 0:
            first[change["name"]] = value
        else:
            later.setdefault(change["name"], []).append(f"tick {int(change['tick'])}: {value}")
    return first, {name: "; ".join(items) for name, items in later.items()}


ROOFLINE_RECENT_TICKS = 20_000  # the per-path roofline summary reads at most the newest this many forwards
ROOFLINE_COLUMNS = ["path", "forwards", "time_weighted_share", "p10_share", "p50_share", "p90_share"]


def roofline_by_path(db: Path, run_id: int) -> pd.DataFrame:
    """Each path's share of its roofline (``ticks.roofline_ns / duration_ns``) over the newest forwards.

    ``time_weighted_share``: the forwards' summed roofline time over their summed measured time
    (what the path reached as a whole); the percentiles are over single forwards. Empty when
    the run recorded no rooflines (an engine that measured no machine rates, or an older store).
    """
    frame = query_df(db, """
        SELECT path, roofline_ns, duration_ns FROM ticks
        WHERE run_id = ? AND path != 'idle' AND roofline_ns IS NOT NULL AND duration_ns > 0
        ORDER BY t_ns DESC LIMIT ?""", [run_id, ROOFLINE_RECENT_TICKS])
    # Newest by t_ns, not id: the (run_id, t_ns) index then hands the rows over newest first and
    # the query stops at the limit; ORDER BY id read every tick of the run and sorted them.
    if frame.empty:
        return pd.DataFrame(columns=ROOFLINE_COLUMNS)
    frame["share"] = frame["roofline_ns"] / frame["duration_ns"]
    rows = []
    for path, group in frame.groupby("path", sort=True):
        rows.append({"path": path, "forwards": len(group),
                     "time_weighted_share": group["roofline_ns"].sum() / group["duration_ns"].sum(),
                     **{f"p{q}_share": group["share"].quantile(q / 100) for q in (10, 50, 90)}})
    return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)
