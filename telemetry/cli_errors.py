"""How both CLIs (``python -m engine`` and ``python -m telemetry``) report an error they did not expect.

A bug must not greet a user with a traceback: one line naming the error, exit 1, and the
traceback only when asked for with ``CHUNKSCOPE_TRACEBACK=1``.
"""
from __future__ import annotations

import os
import sys

TRACEBACK_ENV = "CHUNKSCOPE_TRACEBACK"   # set to 1 to see the traceback of an unexpected error


def report_unexpected(err: Exception) -> int:
    """Print ``err`` on one line and return the exit code; re-raise it when the traceback is asked for."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        raise err
    print(f"error: unexpected {type(err).__name__}: {' '.join(str(err).split())} (set {TRACEBACK_ENV}=1 for the "
          f"traceback)", file=sys.stderr)
    return 1
