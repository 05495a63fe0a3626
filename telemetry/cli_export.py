"""CLI command ``export``: write a bug-report bundle of one run (see ``bundle.py``)."""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from telemetry import cli_args
from telemetry.bundle import BundleError
from telemetry.bundle_export import EXPORT_STEPS, export_bundle
from telemetry.cli_runs import store_problem, with_store


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="write one run as a bug-report bundle zip")
    cli_args.add_store_args(export, live_note=" (may be live)")
    export.add_argument("--run", type=cli_args.run_id, default=None, help="run id (default: the latest run)")
    export.add_argument("-o", "--output", required=True, help="bundle zip to write")
    export.add_argument("--since-s", type=cli_args.non_negative_float, default=None,
                        help="keep rows from this many seconds into the run")
    export.add_argument("--until-s", type=cli_args.non_negative_float, default=None,
                        help="keep rows before this many seconds into the run")
    export.add_argument("--force", action="store_true", help="replace the output if it exists")
    export.set_defaults(handler=with_store(cmd_export))


def cmd_export(args: argparse.Namespace) -> int:

    if (problem := store_problem(args.db)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    # A bar on stderr while the steps run (stdout keeps the one result line); none when stderr is
    # not a terminal (disable=None), so scripts and tests read clean output.
    with tqdm(total=len(EXPORT_STEPS), desc="export", unit="step", file=sys.stderr, disable=None,
              bar_format="{desc}: {n_fmt}/{total_fmt} steps |{bar}| {elapsed} {postfix}") as bar:
        def progress(step: str) -> None:
            if bar.n < EXPORT_STEPS.index(step):
                bar.update(EXPORT_STEPS.index(step) - bar.n)
            bar.set_postfix_str(step)
        try:
            result = export_bundle(args.db, args.output, run_id=args.run, since_s=args.since_s,
                                   until_s=args.until_s, overwrite=args.force, progress=progress)
        except BundleError as exc:
            bar.close()
            print(f"error: {exc}", file=sys.stderr)
            return 1
        bar.update(bar.total - bar.n)
    counts = result.manifest["counts"]
    print(f"wrote {result.path} ({result.num_bytes / 1e6:.2f} MB): run {result.run_id}, "
          f"{counts.get('requests', 0)} requests, {counts.get('ticks', 0)} ticks")
    return 0
