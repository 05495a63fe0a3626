"""Argument types for the command lines: a bad number is an argparse error (one line, exit 2),
never a traceback from deep inside (an OverflowError from SQLite, a MemoryError from a huge cache).

Plain Python so both ``python -m telemetry`` and ``python -m engine`` use them; the engine's named
types (seed, positive counts) live with its commands, in ``engine/cli/args.py``.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

MAX_SQLITE_INT = 2**63 - 1


def bounded_int(low: int, high: int = MAX_SQLITE_INT) -> Callable[[str], int]:
    """An int in [low, high], written in decimal digits."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside [{low}, {high}]")
        return value
    parse.__name__ = "integer"
    return parse


def bounded_float(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] (or (low, high] when ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"{text} is outside {bracket}{low:g}, {high:g}]")
        return value
    parse.__name__ = "number"
    return parse


run_id = bounded_int(1)                      # SQLite rowids start at 1
non_negative_float = bounded_float(0.0)


# One convention for where a command reads (issue 29): ``--run-dir DIR`` names a run directory
# (what ``engine serve --run-dir`` wrote: DIR/telemetry.db, DIR/levers.json) everywhere; ``--db`` and
# ``--file`` stay for the file itself, where a file is what you have.
STORE_NAME = "telemetry.db"
LEVERS_NAME = "levers.json"


def add_store_args(parser: argparse.ArgumentParser, *, live_note: str = "") -> None:
    """``--run-dir DIR`` or ``--db FILE``, exactly one."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", metavar="DIR", default=None,
                       help=f"run directory (as given to engine serve --run-dir): reads DIR/{STORE_NAME}{live_note}")
    where.add_argument("--db", metavar="FILE", default=None,
                       help=f"the telemetry SQLite file itself (instead of --run-dir){live_note}")


def store_path(args: argparse.Namespace) -> str:
    return args.db if args.db is not None else os.path.join(args.run_dir, STORE_NAME)


def add_levers_file_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """``--run-dir DIR`` (its levers.json) or ``--file FILE``."""
    where = parser.add_mutually_exclusive_group(required=required)
    where.add_argument("--run-dir", metavar="DIR", default=None,
                       help=f"run directory (as given to engine serve --run-dir): its {LEVERS_NAME}")
    where.add_argument("--file", metavar="FILE", default=None, help="the levers JSON file itself (instead of --run-dir)")


def levers_path(args: argparse.Namespace) -> str | None:
    if getattr(args, "file", None) is not None:
        return args.file
    return os.path.join(args.run_dir, LEVERS_NAME) if getattr(args, "run_dir", None) is not None else None
