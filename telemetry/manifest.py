"""The bundle's ``manifest.json``: versions, config, levers, time range; nothing private.

Two privacy rules hold for every value written here (a test scans the output):
- environment variables only from ``ENV_ALLOW_LIST`` / ``ENV_ALLOW_PREFIXES``;
- an absolute path inside the run directory becomes relative to it, any other
  absolute path becomes its basename (``/home/me/ckpt/qwen`` -> ``qwen``).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sqlite3
import subprocess
import time
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Mapping

from telemetry import events as ev

ENV_ALLOW_LIST = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
                  "CUBLAS_WORKSPACE_CONFIG", "TORCH_DETERMINISTIC")
ENV_ALLOW_PREFIXES = ("CHUNKSCOPE_",)
EXPORTER_PACKAGES = ("torch", "streamlit", "plotly", "watchdog", "sqlite-utils")

# An absolute POSIX path (not the tail of a relative path), or a Windows drive path. A path
# after ``:`` (``trace:/data/x.csv``) counts; a URL's ``//host/p`` becomes ``p``, which is fine.
_ABS_PATH = re.compile(r"(?<![\w.~/-])(?:/[^\s'\"`,;=()\[\]{}]+|[A-Za-z]:\\[^\s'\"`,;=()\[\]{}]+)")
_HOME_PATH = re.compile(r"(?<![\w./-])~/[^\s'\"`,;=()\[\]{}]*")


# A variable whose name has one of these words (split at "_") is a secret: named, never its value
# (CHUNKSCOPE_API_KEY; not CHUNKSCOPE_MAX_PREFILL_TOKENS).
SECRET_NAME_PARTS = frozenset({"KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD"})
REDACTED = "<redacted>"


def allowed_environment(environ: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The allow-listed variables, values sanitized like every other string; a secret's value redacted."""
    kept = {k: v for k, v in environ.items() if k in ENV_ALLOW_LIST or k.startswith(ENV_ALLOW_PREFIXES)}
    return {k: REDACTED if SECRET_NAME_PARTS & set(k.upper().split("_")) else sanitize_text(kept[k], run_dir)
            for k in sorted(kept)}


def _relative_or_basename(text: str, run_dir: Path) -> str:
    pure = PureWindowsPath(text) if re.match(r"[A-Za-z]:\\", text) else PurePosixPath(text)
    if isinstance(pure, PurePosixPath):
        try:
            relative = Path(os.path.normpath(text)).relative_to(run_dir)
            return str(relative) if str(relative) != "." else "."
        except ValueError:
            pass
    return pure.name or "."


def sanitize_text(text: str, run_dir: Path) -> str:
    """Rewrite every absolute (or ``~``) path in ``text`` (see module docstring)."""
    text = _ABS_PATH.sub(lambda m: _relative_or_basename(m.group(0), run_dir), text)
    return _HOME_PATH.sub(lambda m: PurePosixPath(m.group(0)).name or ".", text)


def sanitize(value: Any, run_dir: Path) -> Any:
    """Apply ``sanitize_text`` to every string (keys included) of a JSON-like value."""
    if isinstance(value, str):
        return sanitize_text(value, run_dir)
    if isinstance(value, dict):
        return {sanitize_text(str(k), run_dir): sanitize(v, run_dir) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v, run_dir) for v in value]
    return value


def project_version() -> str | None:
    try:
        return importlib.metadata.version("chunkscope")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    """HEAD of the checkout this code runs from, when it is one and git is installed."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    revision = out.stdout.strip()
    return revision if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", revision) else None


def exporter_versions() -> dict[str, str | None]:
    """Versions on the exporting side, from package metadata (nothing is imported)."""
    versions: dict[str, str | None] = {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version}
    for name in EXPORTER_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def lever_timeline(run: dict[str, Any], changes: list[dict[str, Any]]) -> dict[str, Any]:
    """Start values plus every recorded change (applied and rejected), by (tick, id)."""
    keys = ("tick", "t_ns", "name", "old", "new", "source", "status", "reason", "file_version")
    ordered = sorted(changes, key=lambda c: (c["tick"], c.get("id", 0)))
    return {"start": dict(run.get("levers") or {}), "changes": [{k: c.get(k) for k in keys} for c in ordered]}


NUMERICS_KEYS = ("dtype", "dtype_choice", "cpu_model", "cpu_isa", "dtype_assumed_cpu")


def run_numerics(config: dict[str, Any]) -> dict[str, Any]:
    """What the run's numbers depend on besides the weights: the dtype it computed in (and the
    ``--dtype`` choice it came from) and the CPU it ran on. ``engine replay`` reads ``dtype`` back."""
    return {key: config.get(key) for key in NUMERICS_KEYS if config.get(key) is not None}


def build_manifest(*, run: dict[str, Any], lever_changes: list[dict[str, Any]], extent: dict[str, Any],
                   since_ns: int | None, until_ns: int | None, counts: dict[str, int],
                   files: dict[str, dict[str, Any]], run_dir: Path, bundle_format: int,
                   environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The manifest dict (see ``bundle.py`` for the format); ``run`` has JSON fields decoded."""
    run_dir = Path(os.path.normpath(os.path.abspath(run_dir)))
    manifest = {
        "bundle_format": bundle_format,
        "schema_version": run.get("schema_version") or ev.SCHEMA_VERSION,
        "created_at": time.time(),
        "chunkscope": {"version": project_version(), "git_revision": git_revision()},
        "run": {"run_id": run["run_id"], "status": run.get("status"), "model": run.get("model"),
                "started_at": run.get("started_at"), "finished_at": run.get("finished_at")},
        "versions": {"run": run.get("versions") or {}, "exporter": exporter_versions()},
        "device": run.get("device"),
        "numerics": run_numerics(run.get("config") or {}),
        "engine_config": run.get("config") or {},
        "model_config": run.get("model_config") or {},
        "checkpoint_hash": run.get("checkpoint_hash") or None,
        "workload": run.get("workload") or {},
        "levers": lever_timeline(run, lever_changes),
        "time_range": {"since_ns": since_ns, "until_ns": until_ns,
                       "is_windowed": since_ns is not None or until_ns is not None, **extent},
        "command_line": run.get("command_line") or "",
        "environment": allowed_environment(os.environ if environ is None else environ, run_dir),
        "counts": counts,
        "files": files,
    }
    return sanitize(manifest, run_dir)
