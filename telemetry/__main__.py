"""``python -m telemetry``: inspect a telemetry store and the levers file.

Each command family lives in its own ``cli_*`` module exposing
``register(subparsers)``; adding a command (e.g. ``export``) is one module plus
one entry in ``COMMAND_MODULES``. Handlers return the exit code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from telemetry.cli_errors import report_unexpected

COMMAND_MODULES = ("telemetry.cli_runs", "telemetry.cli_levers", "telemetry.cli_export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m telemetry", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `python -m telemetry tail | head`
        return 0
    except OSError as err:   # a path the file system refuses (too long, no permission)
        name = str(err.filename or "")[:200]
        print(f"error: {err.strerror or err}" + (f": {name}" if name else ""), file=sys.stderr)
        return 1
    except Exception as err:  # a bug: one line for the user, the traceback on request
        return report_unexpected(err)


if __name__ == "__main__":
    sys.exit(main())
