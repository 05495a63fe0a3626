"""Write a bug-report bundle (format: ``telemetry/bundle.py``) from a live or finished store.

Built on disk, member by member, in a temp directory (the snapshot first; every
other member is derived from it) and zipped at the end; nothing large is held
in memory. The zip appears under its final name only when complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

from telemetry import perfetto, snapshot
from telemetry.bundle import BUNDLE_FORMAT, BUNDLE_MEMBERS, IMAGES_PREFIX, BundleError
from telemetry.manifest import build_manifest, sanitize_text
from telemetry.reader import TelemetryReader
from telemetry.ro_uri import read_only_uri
from telemetry.snapshot import SnapshotError, TimeWindow
from telemetry.summary_md import build_summary_md

_COMPRESSION = {"trace.json.gz": zipfile.ZIP_STORED}  # already gzip; the rest deflate well
# The steps of an export, in order, each reported to ``progress`` as it starts (a bar on the Runs
# page, tqdm on the CLI): a long run's export takes a minute, mostly the snapshot and the trace.
EXPORT_STEPS = ("snapshot", "workload", "trace", "summary", "zip")
Progress = Callable[[str], None]
_HASH_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ExportResult:
    path: Path
    run_id: int
    num_bytes: int
    manifest: dict[str, Any]


def _is_within(path: Path, root: Path) -> bool:
    path, root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return path == root or root in path.parents


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _check_paths(db_path: Path, out_path: Path, allowed_root: Path | None, overwrite: bool) -> None:
    if allowed_root is not None:
        for label, path in (("telemetry db", db_path), ("output", out_path)):
            if not _is_within(path, allowed_root):
                raise BundleError(f"{label} path {path} is outside the allowed directory {allowed_root}")
    if out_path.exists() and not overwrite:
        raise BundleError(f"output {out_path} already exists; choose another name, or replace it (--force)")
    if out_path.exists() and out_path.is_dir():
        raise BundleError(f"output {out_path} is a directory")
    if not out_path.parent.is_dir():
        raise BundleError(f"output directory {out_path.parent} does not exist")


def _write_workload(db_path: Path, dest: Path) -> int:
    """``workload.jsonl`` from the snapshot's requests, by (arrival_tick, request_id)."""
    conn = sqlite3.connect(f"file:{db_path.resolve()}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    num_rows = 0
    try:
        rows = conn.execute("SELECT * FROM requests ORDER BY coalesce(arrival_tick, tick), request_id")
        with dest.open("w", encoding="utf-8") as handle:
            for r in rows:
                sampling = json.loads(r["sampling"] or "{}")
                arrival_ns = r["arrival_ns"] if r["arrival_ns"] is not None else r["t_ns"]
                handle.write(json.dumps({
                    "request_id": r["request_id"], "arrival_tick": r["arrival_tick"], "arrival_ns": arrival_ns,
                    "arrival_s": arrival_ns / 1e9, "prompt_tokens": json.loads(r["prompt_tokens"] or "[]"),
                    "sampling": sampling, "seed": sampling.get("seed"),
                    "conversation_id": r["conversation_id"], "turn": None,
                    # stores written before features / grammars have no such columns
                    "features": json.loads(r["features"]) if "features" in r.keys() and r["features"] else None,
                    **({"grammar": json.loads(r["grammar"])} if "grammar" in r.keys() and r["grammar"] else {}),
                }, separators=(",", ":")) + "\n")
                num_rows += 1
    finally:
        conn.close()
    return num_rows


def _resolve_run(db_path: Path, run_id: int | None) -> int:
    if run_id is not None:
        return run_id
    latest = snapshot.latest_run_id(db_path)
    if latest is None:
        raise BundleError(f"telemetry store {db_path} has no runs yet")
    return latest


def export_bundle(db_path: str | os.PathLike, out_path: str | os.PathLike, *, run_id: int | None = None,
                  since_s: float | None = None, until_s: float | None = None,
                  allowed_root: str | os.PathLike | None = None, overwrite: bool = False,
                  environ: dict[str, str] | None = None, progress: Progress | None = None) -> ExportResult:
    """Write the bundle of one run (default: the latest) of a live or finished store.

    ``since_s`` / ``until_s`` keep only [since, until) seconds after the run
    started. ``allowed_root`` (the dashboard passes the run directory) refuses
    a db or output path outside it. Each member is built in a temp directory
    and the zip is moved into place at the end, so a failure leaves no half file.
    ``progress(step)`` is called as each of ``EXPORT_STEPS`` starts.
    """
    step = progress or (lambda _name: None)
    db_path, out_path = Path(db_path), Path(out_path)
    _check_paths(db_path, out_path, None if allowed_root is None else Path(allowed_root), overwrite)
    try:
        window = TimeWindow.from_seconds(since_s, until_s)
        run_id = _resolve_run(db_path, run_id)
        _check_window_has_rows(db_path, run_id, window)
    except (ValueError, SnapshotError) as exc:
        raise BundleError(str(exc)) from None
    work = Path(tempfile.mkdtemp(prefix="chunkscope-export-"))
    try:
        members = {name: work / name for name in BUNDLE_MEMBERS}
        step("snapshot")
        try:
            snapshot.take_snapshot(db_path, run_id, members["telemetry.db"], window)
        except SnapshotError as exc:
            raise BundleError(str(exc)) from None
        _sanitize_run_row(members["telemetry.db"], run_id, db_path.parent)
        manifest = _manifest(members, run_id, window, db_path.parent, environ, step)
        images = _images(members["workload.jsonl"], db_path.parent / "images")
        manifest["images"] = sorted(images)
        step("zip")
        _write_zip(members, manifest, out_path, work, images)
        return ExportResult(out_path, run_id, out_path.stat().st_size, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_window_has_rows(db_path: Path, run_id: int, window: TimeWindow) -> None:
    """A window that holds no tick of the run would build an empty bundle: refuse it, in seconds."""
    if not window.is_windowed:
        return
    conn = sqlite3.connect(snapshot.read_only_uri(db_path), uri=True)
    try:
        first, last = conn.execute("SELECT min(t_ns), max(t_ns) FROM ticks WHERE run_id = ?", [run_id]).fetchone()
        held = conn.execute("SELECT count(*) FROM ticks WHERE run_id = ? AND t_ns >= ? AND t_ns < ?",
                            [run_id, window.since_ns or 0, window.until_ns or 2**63 - 1]).fetchone()[0]
    except sqlite3.Error as exc:
        raise SnapshotError(f"telemetry store {db_path}: {exc}") from None
    finally:
        conn.close()
    if first is None:
        raise SnapshotError(f"run {run_id} has no ticks, so no time window of it holds any")
    if not held:
        since = (window.since_ns or 0) / 1e9
        until = "the end" if window.until_ns is None else f"{window.until_ns / 1e9:g} s"
        raise SnapshotError(f"the time window {since:g} s to {until} holds no tick of run {run_id}: its ticks span "
                            f"{first / 1e9:.3f} s to {last / 1e9:.3f} s")


_RUN_TEXT_COLUMNS = ("command_line", "config", "model_config", "workload", "levers", "versions", "model",
                     "device", "writer_error")


def _sanitize_run_row(db: Path, run_id: int, run_dir: Path) -> None:
    """The snapshot's ``runs`` row obeys the manifest's path rule too; the host name goes."""
    run_dir = Path(os.path.normpath(os.path.abspath(run_dir)))
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA secure_delete=ON")  # the old text must not linger in free pages
        row = conn.execute(f"SELECT {', '.join(_RUN_TEXT_COLUMNS)} FROM runs WHERE run_id = ?", [run_id]).fetchone()
        clean = [sanitize_text(v, run_dir) if isinstance(v, str) else v for v in row]
        conn.execute(f"UPDATE runs SET {', '.join(f'{c} = ?' for c in _RUN_TEXT_COLUMNS)}, hostname = NULL "
                     "WHERE run_id = ?", [*clean, run_id])
        conn.commit()
    finally:
        conn.close()


def _manifest(members: dict[str, Path], run_id: int, window: TimeWindow, run_dir: Path,
              environ: dict[str, str] | None, step: Progress) -> dict[str, Any]:
    db = members["telemetry.db"]
    reader = TelemetryReader(db)
    run = reader.get_run(run_id)
    changes = reader.events_after("lever_changes", run_id, 0, limit=1_000_000)
    step("workload")
    _write_workload(db, members["workload.jsonl"])
    step("trace")
    perfetto.write_trace(db, members["trace.json.gz"], run_id)
    with sqlite3.connect(read_only_uri(db), uri=True) as conn:
        extent, counts = snapshot.data_extent(conn), snapshot.table_counts(conn)
    common = dict(run=run, lever_changes=changes, extent=extent, since_ns=window.since_ns,
                  until_ns=window.until_ns, counts=counts, run_dir=run_dir, bundle_format=BUNDLE_FORMAT,
                  environ=environ)
    draft = build_manifest(files={}, **common)
    step("summary")
    summary = sanitize_text(build_summary_md(db, run_id, draft), Path(os.path.normpath(os.path.abspath(run_dir))))
    members["summary.md"].write_text(summary, encoding="utf-8")
    files = {name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for name, path in members.items() if name != "manifest.json"}
    return {**draft, "files": files}


def _images(workload: Path, images_dir: Path) -> dict[str, Path]:
    """hash -> file of every image the workload's requests name, from the run's ``images/``."""
    found: dict[str, Path] = {}
    with workload.open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            for key in (row.get("features") or {}).get("images", []):
                path = images_dir / key
                if not path.is_file():
                    raise BundleError(f"request {row['request_id']} names image {key[:12]}.., which is not in "
                                      f"{images_dir}")
                found[key] = path
    return found


def _write_zip(members: dict[str, Path], manifest: dict[str, Any], out_path: Path, work: Path,
               images: dict[str, Path] | None = None) -> None:
    members["manifest.json"].write_text(json.dumps(manifest, indent=2, default=str), encoding="utf-8")
    partial = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
    try:
        with zipfile.ZipFile(partial, "w", allowZip64=True) as zf:
            for name in BUNDLE_MEMBERS:
                zf.write(members[name], name, compress_type=_COMPRESSION.get(name, zipfile.ZIP_DEFLATED),
                         compresslevel=9)
            for key, path in sorted((images or {}).items()):   # encoded images: stored, not recompressed
                zf.write(path, IMAGES_PREFIX + key, compress_type=zipfile.ZIP_STORED)
        os.replace(partial, out_path)
    finally:
        partial.unlink(missing_ok=True)
