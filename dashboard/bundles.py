"""Bug-report bundles from the dashboard: built on request into ``RUN_DIR/bundles/``, served from disk.

Nothing here holds a zip in memory between reruns: ``build_bundle`` writes
the file (through ``telemetry.bundle_export``, which refuses any path outside
the run directory), and the page hands the browser a callable that reads the
file only when the download button is clicked.
"""
from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dashboard.paths import RunPaths
from telemetry.bundle import BundleError
from telemetry.bundle_export import EXPORT_STEPS, ExportResult, Progress, export_bundle

BUNDLE_DIR_NAME = "bundles"
MAX_LISTED = 10


@dataclass(frozen=True)
class BundleFile:
    path: Path
    num_bytes: int
    modified_at: float

    @property
    def label(self) -> str:
        return f"{self.path.name} ({format_size(self.num_bytes)})"


def format_size(num_bytes: int) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def bundle_dir(paths: RunPaths) -> Path:
    return paths.run_dir / BUNDLE_DIR_NAME


def new_bundle_path(paths: RunPaths, run_id: int, since_s: float | None, until_s: float | None,
                    now: float | None = None) -> Path:
    """``bundles/run3-20261202-112233.zip`` (``-w10-40s`` added for a time window); never an existing file."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    window = "" if since_s is None and until_s is None else \
        f"-w{'' if since_s is None else f'{since_s:g}'}-{'' if until_s is None else f'{until_s:g}'}s"
    base = bundle_dir(paths) / f"run{run_id}-{stamp}{window}"
    candidate, n = base.with_suffix(".zip"), 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}.zip")
    return candidate


def window_problem(since_s: float | None, until_s: float | None) -> str | None:
    """Why a time window cannot be exported, or None: seconds since the run started are never
    negative (the page's box once took -5 without a word), and until comes after since."""
    for name, value in (("from", since_s), ("until", until_s)):
        if value is not None and not value >= 0:
            return f"time window: {name} s must be 0 or more (seconds after the run started), got {value:g}"
    if since_s is not None and until_s is not None and until_s <= since_s:
        return f"time window: until ({until_s:g} s) must be after since ({since_s:g} s)"
    return None


def build_bundle(paths: RunPaths, run_id: int, since_s: float | None = None,
                 until_s: float | None = None, progress: Progress | None = None) -> ExportResult:
    """Export one run's bundle into the run directory; BundleError says why when it cannot."""
    problem = window_problem(since_s, until_s)
    if problem:
        raise BundleError(problem)
    if not paths.db.exists():
        raise BundleError(f"no telemetry database at {paths.db}")
    out = new_bundle_path(paths, run_id, since_s, until_s)
    out.parent.mkdir(parents=True, exist_ok=True)
    return export_bundle(paths.db, out, run_id=run_id, since_s=since_s, until_s=until_s,
                         allowed_root=paths.run_dir, progress=progress)


def step_fraction(step: str) -> tuple[float, str]:
    """(share of the export done when ``step`` starts, its label) for the Runs page's bar."""
    index = EXPORT_STEPS.index(step)
    return index / len(EXPORT_STEPS), f"step {index + 1} of {len(EXPORT_STEPS)}: {step}"


def list_bundles(paths: RunPaths, limit: int = MAX_LISTED) -> list[BundleFile]:
    """The newest bundles in ``RUN_DIR/bundles`` (regular ``.zip`` files only)."""
    found = []
    try:
        entries = list(bundle_dir(paths).glob("*.zip"))
    except OSError:
        return []
    for path in entries:
        try:
            stat = path.lstat()
        except OSError:
            continue
        if path.is_file() and not path.is_symlink():
            found.append(BundleFile(path, stat.st_size, stat.st_mtime))
    return sorted(found, key=lambda b: (b.modified_at, b.path.name), reverse=True)[:limit]


def is_windowed(path: Path) -> bool | None:
    """True for a time-windowed bundle (it holds part of a run: no replay), None when unreadable."""
    try:
        with zipfile.ZipFile(path) as archive:
            with archive.open("manifest.json") as handle:
                manifest = json.loads(handle.read(1 << 20))
        return bool((manifest.get("time_range") or {}).get("is_windowed"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, AttributeError):
        return None


def replayable_bundles(files: list[BundleFile]) -> tuple[list[BundleFile], int]:
    """(bundles offered to a replay, how many time-windowed ones were left out).

    An unreadable bundle stays offered: the replay then says exactly what is wrong with it."""
    kept = [b for b in files if is_windowed(b.path) is not True]
    return kept, len(files) - len(kept)


def file_reader(path: Path):
    """A no-argument callable for ``st.download_button``: reads the file only on click."""
    def read() -> bytes:
        return path.read_bytes()
    return read
