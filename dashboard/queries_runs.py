"""Queries behind the Runs page and the run picker: the run list and whole-run summary metrics."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pandas as pd

from dashboard.db import query_df, query_one
from dashboard.queries_live import latency_percentiles
from telemetry.procs import is_pid_alive

RUN_COLUMNS = ("run_id", "started_at", "finished_at", "model", "device", "status", "pid", "hostname",
               "num_events", "num_dropped", "writer_error", "workload", "levers", "config")


def shown_status(status: str, pid, hostname) -> str:
    """A run still marked running whose process died on this host is shown as crashed."""
    if status == "running" and pid is not None and pd.notna(pid) and hostname == socket.gethostname() \
            and not is_pid_alive(int(pid)):
        return "crashed"
    return status


def list_runs(db: Path) -> pd.DataFrame:
    runs = query_df(db, f"SELECT {', '.join(RUN_COLUMNS)} FROM runs ORDER BY run_id DESC")
    if len(runs):
        runs["status"] = [shown_status(s, p, h) for s, p, h in zip(runs["status"], runs["pid"], runs["hostname"])]
    return runs


def run_row(db: Path, run_id: int) -> dict | None:
    row = query_one(db, f"SELECT {', '.join(RUN_COLUMNS)} FROM runs WHERE run_id = ?", [run_id])
    if row is not None:
        row["status"] = shown_status(row["status"], row["pid"], row["hostname"])
        for key in ("workload", "levers", "config"):
            try:
                row[key] = json.loads(row[key]) if row[key] else {}
            except ValueError:
                row[key] = {}
    return row


def _run_rows(db: Path, table: str, run_id: int) -> tuple[str, list]:
    """WHERE clause covering one run's rows as a primary-key range.

    A run's rows are written together, so its id range is a sequential scan
    instead of one index lookup per row.
    """
    # Rows are appended in tick order, so the first / last tick's ids bound the run:
    # two seeks on the (run_id, tick) index instead of a pass over all its entries.
    first = query_one(db, f"SELECT id FROM {table} WHERE run_id = ? ORDER BY tick, id LIMIT 1", [run_id])
    last = query_one(db, f"SELECT id FROM {table} WHERE run_id = ? ORDER BY tick DESC, id DESC LIMIT 1", [run_id])
    if first is None or last is None:
        return "run_id = ?", [run_id]
    return "id BETWEEN ? AND ? AND +run_id = ?", [min(first["id"], last["id"]), max(first["id"], last["id"]), run_id]


def run_metrics(db: Path, run_id: int) -> dict:
    """Whole-run numbers for the comparison table (all aggregated in SQL)."""
    where, params = _run_rows(db, "ticks", run_id)
    ticks = query_one(db, "SELECT COUNT(*) AS num_ticks, COALESCE(SUM(num_prefill_tokens), 0) AS prefill, "
                          "COALESCE(SUM(num_decode_tokens), 0) AS decode, MAX(t_ns + duration_ns) AS end_ns, "
                          f"COALESCE(SUM(path = 'mixed'), 0) AS mixed_ticks FROM ticks WHERE {where}",
                      params) or {}
    where, params = _run_rows(db, "chunks", run_id)
    chunks = query_one(db, "SELECT COUNT(*) AS n, COALESCE(SUM(path = 'mixed'), 0) AS mixed FROM chunks "
                           f"WHERE {where}", params) or {}
    reqs = query_one(db, "SELECT COUNT(*) AS n, COALESCE(SUM(status = 'finished'), 0) AS finished, "
                         "COALESCE(SUM(status = 'error'), 0) AS errors, COALESCE(SUM(prefix_hit_tokens), 0) AS hit, "
                         "COALESCE(SUM(prompt_len), 0) AS prompt FROM requests WHERE run_id = ?", [run_id]) or {}
    preempt = query_one(db, "SELECT COUNT(*) AS n FROM preemptions WHERE run_id = ?", [run_id]) or {}
    duration_s = (ticks.get("end_ns") or 0) / 1e9
    latency = latency_percentiles(db, run_id, is_recent=False).set_index("metric")
    metrics = {
        "duration_s": duration_s,
        "requests": reqs.get("n", 0), "finished": reqs.get("finished", 0), "errors": reqs.get("errors", 0),
        "decode_tok_s": ticks.get("decode", 0) / duration_s if duration_s else None,
        "prefill_tok_s": ticks.get("prefill", 0) / duration_s if duration_s else None,
        "preemptions": preempt.get("n", 0),
        "mixed_share": chunks["mixed"] / chunks["n"] if chunks.get("n") else None,
        "prefix_hit_ratio": reqs["hit"] / reqs["prompt"] if reqs.get("prompt") else None,
        "latency scope": latency["scope"].iloc[0],
    }
    for metric in ("TTFT", "ITL", "e2e"):
        for pct in ("p50", "p90", "p99"):
            value = latency.loc[metric, f"{pct}_ms"]
            metrics[f"{metric} {pct} ms"] = None if value is None or pd.isna(value) else float(value)
    return metrics
