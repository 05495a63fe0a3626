"""CLI commands over the store: ``runs``, ``summary``, ``tail``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from telemetry import events as ev
from telemetry.reader import TAILABLE_TABLES, TelemetryReader, TelemetryUnavailable
from telemetry import cli_args
from telemetry.cli_args import bounded_float


ERRORS_NOTE = "  (" + " + ".join(ev.FAILURE_STATUSES) + ")"


def register(subparsers: argparse._SubParsersAction) -> None:
    runs = subparsers.add_parser("runs", help="list the runs in a store")
    cli_args.add_store_args(runs)
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    runs.set_defaults(handler=with_store(cmd_runs))

    summary = subparsers.add_parser("summary", help="one run's counters and latency percentiles")
    cli_args.add_store_args(summary)
    summary.add_argument("--run", type=cli_args.run_id, default=None, help="run id (default: the latest run)")
    summary.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    summary.set_defaults(handler=with_store(cmd_summary))

    tail = subparsers.add_parser("tail", help="print new events as they are written (Ctrl-C stops)")
    cli_args.add_store_args(tail, live_note=" (may be live)")
    tail.add_argument("--run", type=cli_args.run_id, default=None, help="run id (default: the latest run)")
    tail.add_argument("--interval", type=bounded_float(0.01, 3600.0), default=0.25, help="poll interval in seconds")
    tail.add_argument("--once", action="store_true", help="print everything written so far and exit")
    tail.set_defaults(handler=with_store(cmd_tail))


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def with_store(handler):
    """``args.db`` becomes the store's path whichever of --run-dir / --db named it."""
    def run(args: argparse.Namespace) -> int:
        args.db = cli_args.store_path(args)
        return handler(args)
    return run


def store_problem(db: str) -> str | None:
    """Why ``db`` cannot be a telemetry store at all (absent, a directory), or None."""
    if os.path.isdir(db):
        inside = os.path.join(db, "telemetry.db")
        hint = f"; did you mean {inside}?" if os.path.exists(inside) else ""
        return (f"{db} is a directory, not a telemetry store (--db takes the telemetry.db file; "
                f"--run-dir takes a run directory){hint}")
    if not os.path.exists(db):
        return f"no telemetry store at {db}"
    return None


def cmd_runs(args: argparse.Namespace) -> int:
    if (problem := store_problem(args.db)) is not None:
        return _fail(problem)
    try:
        runs = TelemetryReader(args.db).list_runs()
    except TelemetryUnavailable as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(runs, indent=2, default=str))
        return 0
    if not runs:
        print(f"no telemetry yet in {args.db}")
        return 0
    # Columns as wide as their widest value: nothing is cut ("cpu (Intel(R" was), the device goes last.
    model_w = max(5, *(len(str(r["model"])) for r in runs))
    print(f"{'run':>4}  {'status':<9} {'started':<19} {'model':<{model_w}} {'events':>9} {'dropped':>7}  device")
    for run in runs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["started_at"] or 0))
        print(f"{run['run_id']:>4}  {run['status']:<9} {started:<19} {str(run['model']):<{model_w}} "
              f"{run['num_events'] or 0:>9} {run['num_dropped'] or 0:>7}  {run['device']}")
    return 0


def _resolve_run(reader: TelemetryReader, run_id: int | None) -> int | None:
    return reader.latest_run_id() if run_id is None else run_id


def cmd_summary(args: argparse.Namespace) -> int:
    if (problem := store_problem(args.db)) is not None:
        return _fail(problem)
    reader = TelemetryReader(args.db)
    try:
        run_id = _resolve_run(reader, args.run)
        summary = reader.run_summary(run_id) if run_id is not None else None
    except TelemetryUnavailable as exc:
        return _fail(str(exc))
    if summary is None:
        return _fail(f"no run {args.run} in {args.db}" if args.run is not None else f"no telemetry yet in {args.db}")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            note = ERRORS_NOTE if key == "errors" else ""
            print(f"{key:<18} {round(value, 3) if isinstance(value, float) else value}{note}")
    return 0


def format_row(table: str, row: dict[str, Any]) -> str:
    skip = {"id", "run_id", "tick", "t_ns"}
    fields = " ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
                      for k, v in row.items() if k not in skip and v is not None)
    return f"{row.get('t_ns', 0) / 1e6:>11.3f}ms  tick {row.get('tick')!s:>6}  {table:<14} {fields}"


def cmd_tail(args: argparse.Namespace) -> int:
    reader = TelemetryReader(args.db)
    last_ids = {table: 0 for table in TAILABLE_TABLES}
    run_id = args.run
    if args.once:  # one look: what is not there now is an error, not something to wait for
        try:
            problem = store_problem(args.db) or _missing_run(reader, run_id, args.db)
        except TelemetryUnavailable as exc:
            problem = str(exc)
        if problem is not None:
            return _fail(problem)
    try:
        while True:
            try:
                run_id = _resolve_run(reader, run_id)
                new_rows: list[tuple[int, str, dict[str, Any]]] = []
                if run_id is not None:
                    for table in TAILABLE_TABLES:
                        rows = reader.events_after(table, run_id, last_ids[table], limit=5000)
                        if rows:
                            last_ids[table] = rows[-1]["id"]
                        new_rows += [(r.get("t_ns") or 0, table, r) for r in rows]
            except TelemetryUnavailable as exc:  # transient while polling: say so, keep going
                print(f"waiting: {exc}", file=sys.stderr)
                new_rows = []
            for _, table, row in sorted(new_rows, key=lambda item: item[0]):
                print(format_row(table, row), flush=False)
            sys.stdout.flush()
            if args.once and not new_rows:
                return 0
            if args.once:
                continue
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _missing_run(reader: TelemetryReader, run_id: int | None, db: str) -> str | None:
    if run_id is None:
        return None if reader.latest_run_id() is not None else f"no runs yet in {db}"
    return None if reader.get_run(run_id) is not None else f"no run {run_id} in {db}"
