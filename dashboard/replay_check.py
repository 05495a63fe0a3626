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
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dashboard.paths import PathOutsideRunDir, RunPaths, inside_run_dir
from telemetry.levers import LEVERS_BY_NAME, LeversError

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300.0
POLL_S = 0.2      # how often a running replay's progress lines are read
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
               timeout_s: float = TIMEOUT_S, on_progress: Callable[[int, int], None] | None = None) -> ReplayOutcome:
    """Run the replay to completion; ReplayCheckError carries the subprocess's one-line message.
    ``on_progress(tick, total)``: called as the replay's ``--progress-lines`` arrive (about 4 a second)."""
    flips = dict(flips or {})
    argv = replay_argv(paths, bundle, flips) + ["--progress-lines"]
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Both streams to files, polled: a pipe the dashboard did not drain could block the replay. The
    # child shares the stderr file's offset, so the polls read it with pread, never moving it.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        except OSError as exc:
            raise ReplayCheckError(f"cannot start the replay: {exc}") from None
        try:
            shown = None
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    raise ReplayCheckError(f"replay did not finish within {timeout_s:g} s")
                time.sleep(POLL_S)
                shown = _report_progress(err, shown, on_progress)
            _report_progress(err, shown, on_progress)
            stdout, stderr = _read_all(out), _read_all(err)
        finally:   # a timeout, or the page rerun while the bar moved: no replay left running unread
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise ReplayCheckError(f"replay failed (exit {proc.returncode}): {_last_line(_without_progress(stderr))[:500]}")
    return ReplayOutcome(parse_report(stdout), flips, str(argv[4]), time.monotonic() - start)


def _read_all(file) -> str:
    """The whole file, read at offset 0 without moving the offset a child process shares."""
    return os.pread(file.fileno(), os.fstat(file.fileno()).st_size, 0).decode(errors="replace")


def _report_progress(err, shown, on_progress) -> tuple[int, int] | None:
    """The newest ``progress TICK TOTAL`` line in the stderr file, passed on when it moved."""
    if on_progress is None:
        return shown
    newest = None
    for line in _read_all(err).splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "progress" and words[1].isdigit() and words[2].isdigit():
            newest = (int(words[1]), int(words[2]))
    if newest is not None and newest != shown:
        on_progress(*newest)
        return newest
    return shown


def _without_progress(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("progress "))


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
