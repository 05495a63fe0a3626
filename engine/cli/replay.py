"""``python -m engine replay``: its options, ``--flip`` parsing and the printed report; the re-run
itself is ``engine/replay/rerun.py``."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tqdm import tqdm

from engine.cli.kv_cache_args import add_kv_cache_args, kv_cache_options
from engine.replay import divergence, flips as replay_flips, run_dtype, stall_report
from engine.replay.compare import compare, text_report
from engine.model.reproducible import NUMERICS_CHOICES, REPRODUCIBLE
from engine.replay.rerun import load_input, recorded_kv_cache, recorded_numerics, replay_run, resolve_model
from telemetry import cli_args
from telemetry.levers import LEVERS_BY_NAME, LeversError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("replay", help="re-run a recorded run and compare decisions and tokens")
    p.add_argument("bundle", nargs="?", default=None,
                   help="a bug-report bundle (.zip), or a telemetry.db / run directory (or --run-dir DIR)")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="replay the run recorded in this run directory (as given to serve --run-dir)")
    p.add_argument("--run", type=cli_args.run_id, default=None, help="run id inside a telemetry.db (default: latest)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    p.add_argument("--flip", action="append", default=[], metavar="NAME=VALUE",
                   help="override a lever for the whole replay (repeatable), e.g. bisect_no_mix=true")
    p.add_argument("--model", default=None, help="an embedded model (tiny, tiny-moe, tiny-kimi, tiny-vl; trained: tiny-chat, tiny-chat-moe) or a checkpoint directory (default: the run's model when embedded)")
    p.add_argument("--numerics", choices=NUMERICS_CHOICES, default=None,
                   help="default: the run's own mode (reproducible when serve ran with --numerics reproducible, "
                        "which replays identically on any CPU family); native turns it off")
    add_kv_cache_args(p, from_run=True)
    p.add_argument("--progress-lines", action="store_true",
                   help="print 'progress TICK TOTAL' lines on stderr as it runs (what the dashboard's bar reads)")
    p.add_argument("--ignore-checkpoint-hash", action="store_true",
                   help="replay even when the checkpoint differs from the recorded one (warns)")
    p.set_defaults(func=run)


def parse_flips(items: list[str]) -> dict[str, Any]:
    """``["bisect_no_mix=true", ...]`` -> {name: checked value}; a bad item raises LeversError."""
    flips: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise LeversError(f"--flip {item!r}: expected NAME=VALUE, e.g. bisect_no_mix=true")
        lever = LEVERS_BY_NAME.get(name)
        if lever is None:
            raise LeversError(f"--flip {item!r}: unknown lever {name!r} (known: {', '.join(LEVERS_BY_NAME)})")
        flips[name] = lever.parse_text(text)
    return flips


def numerics_note(recorded: str, used: str) -> str:
    """One line: the numerics mode the replay runs in, and what identity it can promise."""
    if used != recorded:
        return (f"replaying in {used} numerics, the run recorded {recorded}: tokens are not expected to match")
    if used == REPRODUCIBLE:
        return "replaying in reproducible numerics (as recorded): identical on any x86 CPU family"
    return ("replaying in native numerics (as recorded): identical on this CPU family only; record with "
            "serve --numerics reproducible for a bundle another CPU replays identically")


class ProgressLines:
    """``progress TICK TOTAL`` on stderr, at most every ``every_s`` seconds and once at the end."""

    def __init__(self, total: int, every_s: float = 0.25):
        self.total, self.every_s, self.last_s, self.at = total, every_s, 0.0, 0

    def tick(self, tick: int) -> None:
        self.at = max(self.at, tick)
        now = time.monotonic()
        if now - self.last_s >= self.every_s:
            self.last_s = now
            self._print()

    def done(self) -> None:
        self.at = max(self.at, self.total)
        self._print()

    def _print(self) -> None:
        print(f"progress {min(self.at, self.total) if self.total else self.at} {self.total}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if (args.bundle is None) == (args.run_dir is None):
        raise ValueError("give what to replay once: a bundle .zip / telemetry.db / run directory, or --run-dir DIR")
    args.bundle = args.bundle if args.bundle is not None else args.run_dir
    flips = parse_flips(args.flip)
    recorded, _manifest = load_input(args.bundle, args.run)
    flips, no_op_notes = replay_flips.split_no_op_flips(recorded, flips)
    for note in no_op_notes:
        print(note, file=sys.stderr)
    model, warnings = resolve_model(recorded, args.model, ignore_hash=args.ignore_checkpoint_hash)
    for warning in warnings:
        print(warning, file=sys.stderr)
    numerics = args.numerics or recorded_numerics(recorded.config)
    # A tick bar on stderr while it runs (none when stderr is not a terminal: the dashboard, scripts),
    # or with --progress-lines plain lines a reader parses.
    lines = ProgressLines(recorded.num_ticks) if args.progress_lines else None
    with tqdm(total=recorded.num_ticks or None, desc="replay", unit="tick", file=sys.stderr,
              disable=None if lines is None else True, leave=False) as bar:
        def progress(tick: int) -> None:
            bar.update(max(0, tick + 1 - bar.n))
            if lines is not None:
                lines.tick(tick + 1)

        replayed = replay_run(recorded, model=model, flips=flips, numerics=numerics,
                              kv_cache=kv_cache_options(args, recorded_kv_cache(recorded.config)),
                              progress=progress)
    if lines is not None:
        lines.done()
    # after the replay ran: a dtype it refuses is the only line a refused replay prints
    print(numerics_note(recorded_numerics(recorded.config), numerics), file=sys.stderr)
    report = compare(recorded, replayed)
    report["flips"] = flips
    report["run_id"] = recorded.run_id
    report["numerics_mode"] = numerics
    report["lever_changes_replayed"] = replayed.lever_log
    report["stall"] = stall_report.stall_section(
        recorded.stalls, len(recorded.lever_changes), replayed.lever_log, replayed.blocked,
        stall_report.ttft_ms(recorded.requests), replayed.ttft_ms)
    report["stall"]["lines"] = stall_report.stall_lines(report["stall"])   # the Runs page shows these as they are
    report["notes"] = list(recorded.notes) + warnings + no_op_notes
    report["numerics"] = run_dtype.numerics(recorded.config, replayed.dtype, replayed.device)
    report["divergence_cause"] = divergence.explain(report, recorded, replayed.model, replayed.dtype, bool(flips))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(text_report(report, flips=flips, notes=report["notes"]))
        print(divergence.cause_line(report["divergence_cause"]))
        print(run_dtype.numerics_line(report["numerics"]))
    return 0
