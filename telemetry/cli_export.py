"""CLI command ``export``: write a bug-report bundle of one run (see ``bundle.py``)."""
from __future__ import annotations

import argparse
import sys

from telemetry.bundle import BundleError
from telemetry.bundle_export import export_bundle
from telemetry import cli_args


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="write one run as a bug-report bundle zip")
    export.add_argument("--db", required=True, help="telemetry SQLite file (may be live)")
    export.add_argument("--run", type=cli_args.run_id, default=None, help="run id (default: the latest run)")
    export.add_argument("-o", "--output", required=True, help="bundle zip to write")
    export.add_argument("--since-s", type=cli_args.non_negative_float, default=None,
                        help="keep rows from this many seconds into the run")
    export.add_argument("--until-s", type=cli_args.non_negative_float, default=None,
                        help="keep rows before this many seconds into the run")
    export.add_argument("--force", action="store_true", help="replace the output if it exists")
    export.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from telemetry.cli_runs import store_problem

    if (problem := store_problem(args.db)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        result = export_bundle(args.db, args.output, run_id=args.run, since_s=args.since_s,
                               until_s=args.until_s, overwrite=args.force)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    counts = result.manifest["counts"]
    print(f"wrote {result.path} ({result.num_bytes / 1e6:.2f} MB): run {result.run_id}, "
          f"{counts.get('requests', 0)} requests, {counts.get('ticks', 0)} ticks")
    return 0
