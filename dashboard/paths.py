"""Where the dashboard's files live, and the guard that keeps typed paths inside the run dir.

The run directory comes from ``streamlit run dashboard/app.py -- --run-dir DIR``,
else the ``CHUNKSCOPE_RUN_DIR`` environment variable, else ``runs/default``.
Nothing typed in the UI reaches the filesystem unless it resolves inside it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

DEFAULT_RUN_DIR = "runs/default"
ENV_RUN_DIR = "CHUNKSCOPE_RUN_DIR"
DB_NAME = "telemetry.db"
LEVERS_NAME = "levers.json"
PID_NAME = "engine.pid"
ENGINE_LOG_NAME = "engine.log"


class PathOutsideRunDir(ValueError):
    """A typed path that would escape the run directory."""


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path

    @property
    def db(self) -> Path:
        return self.run_dir / DB_NAME

    @property
    def levers(self) -> Path:
        return self.run_dir / LEVERS_NAME

    @property
    def pid_file(self) -> Path:
        return self.run_dir / PID_NAME

    @property
    def engine_log(self) -> Path:
        return self.run_dir / ENGINE_LOG_NAME


def run_dir_from(argv: Sequence[str], environ: Mapping[str, str]) -> Path:
    """``--run-dir`` beats ``CHUNKSCOPE_RUN_DIR`` beats the default; returned absolute."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--run-dir", default=None)
    known, _ = parser.parse_known_args(list(argv))
    chosen = known.run_dir or environ.get(ENV_RUN_DIR) or DEFAULT_RUN_DIR
    return Path(chosen).expanduser().resolve()


def inside_run_dir(run_dir: Path, typed: str) -> Path:
    """Resolve ``typed`` relative to ``run_dir``; refuse anything that lands outside it.

    Absolute paths, ``..`` hops and symlinks pointing out are all caught because
    the check runs on the fully resolved path.
    """
    text = (typed or "").strip()
    if not text:
        raise PathOutsideRunDir("empty path: type a path inside the run directory")
    if "\x00" in text:
        raise PathOutsideRunDir(f"path {text!r} contains a NUL byte")
    root = Path(run_dir).resolve()
    try:
        candidate = (root / text).resolve()
    except (OSError, RuntimeError) as exc:   # a name too long, a symlink loop
        raise PathOutsideRunDir(f"path {text[:80]!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if candidate != root and not candidate.is_relative_to(root):
        raise PathOutsideRunDir(f"path {text!r} is outside the run directory {root}")
    return candidate


def current_paths() -> RunPaths:
    """The run paths for this dashboard process (CLI args after ``--``, then env)."""
    import sys

    return RunPaths(run_dir_from(sys.argv[1:], os.environ))
