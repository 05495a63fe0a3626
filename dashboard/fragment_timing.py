"""How long each dashboard script run and fragment run takes, logged at debug level.

A browser session runs one script or fragment at a time: a fragment rerun that
comes due while another runs waits for it. So the stall banner's 0.5 s fragment
is only as quick as the slowest fragment beside it, and each one's run time is
the number to watch. ``timed(name)`` wraps a fragment body and logs
``"<name> <seconds>"`` to the ``chunkscope.dashboard.timing`` logger.

``CHUNKSCOPE_DASH_TIMING_LOG=FILE`` (set by ``bench/stall.py``) sends those
lines to FILE; otherwise the logger stays silent and a run costs two
``perf_counter`` calls.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

ENV_LOG = "CHUNKSCOPE_DASH_TIMING_LOG"
log = logging.getLogger("chunkscope.dashboard.timing")

F = TypeVar("F", bound=Callable)


def configure_from_env(environ=os.environ) -> None:
    """Add a file handler for ``CHUNKSCOPE_DASH_TIMING_LOG`` once per process (Streamlit re-runs app.py)."""
    target = environ.get(ENV_LOG)
    if not target or any(getattr(h, "_chunkscope_timing", False) for h in log.handlers):
        return
    handler = logging.FileHandler(target)
    handler.setFormatter(logging.Formatter("%(created).3f %(message)s"))
    handler._chunkscope_timing = True
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False


def timed(name: str) -> Callable[[F], F]:
    """Log the wrapped call's wall time under ``name`` (exceptions included: Streamlit's rerun
    and stop signals travel as exceptions through a fragment body)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s %.4f", name, time.perf_counter() - started)
        return run   # type: ignore[return-value]
    return wrap


def read_timings(path: str | os.PathLike) -> dict[str, list[float]]:
    """The run times in a timing log, seconds per name, in the order they were logged."""
    out: dict[str, list[float]] = {}
    try:
        lines: Iterable[str] = Path(path).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            try:
                out.setdefault(parts[1], []).append(float(parts[2]))
            except ValueError:
                continue
    return out
