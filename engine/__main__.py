"""``python -m engine <command>``: a thin argparse dispatcher.

Adding a command is two lines: import its module below and list it in COMMANDS. Each
module provides ``add_parser(subparsers)`` that registers its sub-parser with
``set_defaults(func=run)``, and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from engine.cli import generate, replay, serve
from telemetry.cli_errors import report_unexpected

COMMANDS = [generate, serve, replay]

# Errors a user can cause with bad input: reported as one line, exit status 2.
from engine.cache.kv import KVCacheExhausted  # noqa: E402
from engine.cache.ssm_pool import SSMPoolExhausted  # noqa: E402
from engine.model.loader import CheckpointError  # noqa: E402
from engine.model.errors import RankFailure  # noqa: E402

EXIT_RANK_FAILURE = 3

USER_ERRORS = (ValueError, CheckpointError, KVCacheExhausted, SSMPoolExhausted, OSError)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m engine", description="Chunkscope inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        with torch.no_grad():   # inference only; scoped, so a caller in the same process keeps its grad mode
            return args.func(args)
    except USER_ERRORS as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except RankFailure as err:  # an expert-parallel rank died or hung: the run ended, every rank exits
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RANK_FAILURE
    except MemoryError:
        print("error: out of memory: ask for fewer KV blocks, SSM slots or tokens", file=sys.stderr)
        return 2
    except Exception as err:  # a bug: one line for the user, the traceback on request
        return report_unexpected(err)

def one_line(err: BaseException) -> str:
    """The error's message on one line (an OSError with its path, long paths shortened)."""
    if isinstance(err, OSError) and err.strerror:
        name = str(err.filename or "")
        name = name if len(name) <= 200 else name[:100] + "..." + name[-40:]
        return f"{err.strerror}: {name}" if name else err.strerror
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
