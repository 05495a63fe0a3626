"""The divergence check: ``python -m engine replay BUNDLE --json [--flip NAME=VALUE]`` as a subprocess.

The dashboard never imports the engine; it runs the replay CLI with this
interpreter and reads its ``--json`` contract (``engine/replay/compare.py``):
``decisions_identical``, ``tokens_identical``, ``first_divergence`` and one
row per request. ``headline`` and ``request_table`` turn that into what the
Runs page shows; they are pure, so they are tested on plain dicts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dashboard.paths import PathOutsideRunDir, RunPaths, inside_run_dir
from telemetry.levers import LEVERS_BY_NAME, LeversError

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300.0
REQUEST_COLUMNS = ("request_id", "tokens_identical", "first_token_diff", "recorded_len", "replayed_len",
                   "status_recorded", "status_replayed")


class ReplayCheckError(RuntimeError):
    """The replay could not run or its output was not the JSON contract; the message is one line."""


@dataclass(frozen=True)
class ReplayOutcome:
    report: dict[str, Any]
    flips: dict[str, Any]
    bundle: str
    seconds: float


def flip_text(name: str, value: Any) -> str:
    """``NAME=VALUE`` as the replay CLI parses it (booleans as true / false), checked by the registry."""
    lever = LEVERS_BY_NAME.get(name)
    if lever is None:
        raise ReplayCheckError(f"unknown lever {name!r}")
    try:
        lever.check(value)
    except LeversError as exc:
        raise ReplayCheckError(str(exc)) from None
    return f"{name}={str(value).lower() if isinstance(value, bool) else value}"


def replay_argv(paths: RunPaths, bundle: str | Path, flips: dict[str, Any]) -> list[str]:
    """The replay command line; the bundle must be a ``.zip`` inside the run directory."""
    try:
        path = inside_run_dir(paths.run_dir, str(bundle))
    except PathOutsideRunDir as exc:
        raise ReplayCheckError(f"bundle: {exc}") from None
    if path.suffix != ".zip" or not path.is_file():
        raise ReplayCheckError(f"bundle: {path} is not a bundle .zip file")
    argv = [sys.executable, "-m", "engine", "replay", str(path), "--json"]
    for name, value in flips.items():
        argv += ["--flip", flip_text(name, value)]
    return argv


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def parse_report(stdout: str) -> dict[str, Any]:
    """The JSON object on the last line of stdout, checked for the contract's fields."""
    try:
        report = json.loads(_last_line(stdout))
    except ValueError:
        raise ReplayCheckError(f"replay printed no JSON report: {_last_line(stdout)[:300]}") from None
    missing = [k for k in ("decisions_identical", "tokens_identical", "first_divergence", "requests")
               if not isinstance(report, dict) or k not in report]
    if missing:
        raise ReplayCheckError(f"replay report lacks {', '.join(missing)}")
    return report


def run_replay(paths: RunPaths, bundle: str | Path, flips: dict[str, Any] | None = None,
               timeout_s: float = TIMEOUT_S) -> ReplayOutcome:
    """Run the replay to completion; ReplayCheckError carries the subprocess's one-line message."""
    flips = dict(flips or {})
    argv = replay_argv(paths, bundle, flips)
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ReplayCheckError(f"replay did not finish within {timeout_s:g} s") from None
    except OSError as exc:
        raise ReplayCheckError(f"cannot start the replay: {exc}") from None
    if done.returncode != 0:
        raise ReplayCheckError(f"replay failed (exit {done.returncode}): {_last_line(done.stderr)[:500]}")
    return ReplayOutcome(parse_report(done.stdout), flips, str(argv[4]), time.monotonic() - start)


def headline(report: dict[str, Any]) -> tuple[str, str]:
    """("success" | "warning", one sentence): identical tokens, or how many requests differ and where first."""
    rows = report.get("requests") or []
    num_differ = sum(not r.get("tokens_identical") for r in rows)
    decisions = "identical" if report.get("decisions_identical") else "different"
    if num_differ == 0 and report.get("tokens_identical"):
        return "success", (f"Batch-invariant: no token differs in {len(rows)} requests "
                           f"(chunk decisions {decisions}).")
    first = report.get("first_divergence") or {}
    where = (f"; first divergence at tick {first.get('tick')} request {first.get('request_id')} "
             f"field {first.get('field')}") if first else ""
    return "warning", f"{num_differ} of {len(rows)} requests differ (chunk decisions {decisions}){where}."


def request_table(report: dict[str, Any]) -> pd.DataFrame:
    """One row per request, differing requests first."""
    frame = pd.DataFrame(report.get("requests") or [], columns=list(REQUEST_COLUMNS))
    frame = frame.reindex(columns=list(REQUEST_COLUMNS))
    return frame.sort_values(["tokens_identical", "request_id"], kind="stable").reset_index(drop=True)
