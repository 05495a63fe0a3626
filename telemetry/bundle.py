"""Bug-report bundles: one zip that holds everything needed to read and replay a run.

Format (``BUNDLE_FORMAT = 1``), a zip with exactly these members:

``manifest.json`` (UTF-8 JSON object)::

    {
      "bundle_format": 1,                  # refuse to open when > ours
      "schema_version": 1,                 # telemetry schema of telemetry.db; refuse when > ours
      "created_at": 1796209600.0,          # unix seconds (display only)
      "chunkscope": {"version": "0.1.0" | null, "git_revision": "<40 hex>" | null},
      "run": {"run_id": 1, "status": "running|finished|crashed", "model": "tiny",
              "started_at": <unix s>, "finished_at": <unix s> | null},
      "versions": {"run": {python, torch, sqlite, streamlit, plotly, watchdog, ...},   # engine side
                   "exporter": {python, sqlite, streamlit, plotly, watchdog, sqlite-utils, torch}},
      "device": "cpu (AMD EPYC, 1 threads)",
      "engine_config": {...},              # runs.config
      "model_config": {...},               # runs.model_config (config.json text part)
      "checkpoint_hash": "<sha256 hex>",
      "workload": {...},                   # runs.workload (the generator's description, paths sanitized)
      "levers": {
        "start": {"max_prefill_tokens": 256, ...},        # runs.levers: values in force at tick 0
        "changes": [{"tick": 40, "t_ns": 123, "name": "bisect_no_mix", "old": false,
                     "new": true, "source": "file", "status": "applied" | "rejected",
                     "reason": null, "file_version": 3}, ...]   # by (tick, id); all rows
      },                                   # replay applies only status == "applied", at the
                                           # start of the change's tick (before scheduling it)
      "time_range": {"since_ns": null | int, "until_ns": null | int,  # the window asked for
                     "is_windowed": false,
                     "first_ns": int | null, "last_ns": int | null,   # data extent in the bundle
                     "first_tick": int | null, "last_tick": int | null},
      "command_line": "python -m engine serve --model tiny --run-dir . ...",
      "environment": {"OMP_NUM_THREADS": "1", "CHUNKSCOPE_...": "..."},   # allow-list only
      "counts": {"<table>": rows, ...},    # rows of each table in telemetry.db
      "files": {"telemetry.db": {"bytes": n, "sha256": hex}, "trace.json.gz": ..., ...}
    }

All ``*_ns`` times are run-relative monotonic nanoseconds (the ``t_ns`` of the
rows). Paths: a path inside the run directory is written relative to it;
any other absolute path becomes its basename. No environment variable outside
``ENV_ALLOW_LIST`` / ``ENV_ALLOW_PREFIXES`` is ever written.

``telemetry.db``: a SQLite snapshot of that one run (same tables as the live
store, shipped without the ``idx_*`` indexes, which ``open_bundle`` rebuilds;
other runs' rows removed; with a window, rows whose ``t_ns`` falls
outside [since_ns, until_ns) removed, and requests kept when their lifetime
overlaps the window). Taken with ``VACUUM INTO`` from a read-only connection,
so it is consistent while the engine writes; every other member is derived
from this snapshot, so the files agree with each other.

``workload.jsonl``: one JSON object per request of the snapshot, sorted by
(arrival_tick, request_id), in the format ``engine/workload/bundle.py`` reads::

    {"request_id": 3, "arrival_tick": 12, "arrival_ns": 410000000, "arrival_s": 0.41,
     "prompt_tokens": [..], "sampling": {"temperature": 0.0, "max_tokens": 16,
     "seed": 7, ...}, "seed": 7, "conversation_id": null, "turn": null}

The recorded outputs (for a replay's token comparison) are in
``telemetry.db``: ``requests.output_tokens`` and the ``tokens`` table; the
recorded chunk decisions are the ``chunks`` table.

``images/<sha256>``: the images the requests name (``features.images``), content-addressed: each
member's name is the sha256 of its bytes (checked on open), so a replay finds them by the hash.

``trace.json.gz``: Chrome trace JSON (gzip) for Perfetto, see ``perfetto.py``.

``summary.md``: the run in numbers, errors by message, lever changes, top preemptions.

``open_bundle(path) -> Bundle`` (here) validates and extracts a bundle, or
raises ``BundleError`` with one clear message; ``telemetry.bundle_export.
export_bundle(db, out, run_id=None, since_s=None, until_s=None)`` writes one.
"""
from __future__ import annotations

BUNDLE_FORMAT = 1
BUNDLE_MEMBERS = ("manifest.json", "telemetry.db", "trace.json.gz", "workload.jsonl", "summary.md")
IMAGES_PREFIX = "images/"   # optional members: images/<sha256 of the bytes>

import dataclasses
import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import weakref
import zipfile
import zlib
from pathlib import Path
from typing import Any

from telemetry.events import SCHEMA_VERSION
from telemetry.ro_uri import read_only_uri
from telemetry.snapshot import restore_indexes

_READ_CHUNK = 1 << 20


class BundleError(RuntimeError):
    """A bundle cannot be written or opened; the message names the file and the reason."""


@dataclasses.dataclass
class Bundle:
    """An opened, validated bundle; its members are extracted under ``directory`` until ``close()``."""

    path: Path                          # the zip
    directory: Path                     # temp dir holding the extracted members
    manifest: dict[str, Any]
    workload: list[dict[str, Any]]      # workload.jsonl rows, file order
    lever_timeline: dict[str, Any]      # {"start": {...}, "changes": [...]}
    db_path: Path                       # extracted telemetry.db (open it read-only)
    trace_path: Path                    # extracted trace.json.gz
    workload_path: Path                 # extracted workload.jsonl (engine/workload/bundle.py reads it)
    summary_md: str

    @property
    def images_dir(self) -> Path:
        """The extracted ``images/`` (one file per content hash; absent when no request had images)."""
        return self.directory / "images"

    @property
    def run_id(self) -> int:
        return int(self.manifest["run"]["run_id"])

    @property
    def applied_lever_changes(self) -> list[dict[str, Any]]:
        """Changes a replay applies, by tick (rejected ones are history only)."""
        return [c for c in self.lever_timeline["changes"] if c.get("status") == "applied"]

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_version(manifest: dict[str, Any], key: str, label: str, ours: int, where: str) -> None:
    value = manifest.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BundleError(f"{where}: manifest.json field {key!r} must be a positive integer, got {value!r}")
    if value > ours:
        raise BundleError(f"{label} {value} is newer than this Chunkscope ({ours}); upgrade to open it")


def _read_manifest(zf: zipfile.ZipFile, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(zf.read("manifest.json").decode("utf-8"))
    except (zipfile.BadZipFile, zlib.error, OSError) as exc:
        raise BundleError(f"{where} is corrupted: manifest.json cannot be read ({exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{where}: manifest.json is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: manifest.json must hold a JSON object, got {type(manifest).__name__}")
    _check_version(manifest, "bundle_format", "bundle format", BUNDLE_FORMAT, where)
    _check_version(manifest, "schema_version", "bundle schema", SCHEMA_VERSION, where)
    for key in ("run", "levers", "time_range", "files"):
        if not isinstance(manifest.get(key), dict):
            raise BundleError(f"{where}: manifest.json field {key!r} is missing or not an object")
    if not isinstance(manifest["run"].get("run_id"), int):
        raise BundleError(f"{where}: manifest.json field 'run.run_id' must be an integer")
    return manifest


def _extract(zf: zipfile.ZipFile, name: str, dest: Path, expected: dict[str, Any] | None, where: str) -> None:
    """Copy one member out in chunks, checking its CRC (zipfile) and the manifest's sha256."""
    digest = hashlib.sha256()
    try:
        with zf.open(name) as src, dest.open("wb") as out:
            while block := src.read(_READ_CHUNK):
                digest.update(block)
                out.write(block)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise BundleError(f"{where} is corrupted: member {name} cannot be read ({exc})") from None
    if expected is not None and expected.get("sha256") not in (None, digest.hexdigest()):
        raise BundleError(f"{where} is corrupted: member {name} does not match the sha256 in manifest.json")


def _extract_images(zf: zipfile.ZipFile, directory: Path, where: str) -> None:
    """The ``images/<sha256>`` members, each checked against its own name."""
    names = [n for n in zf.namelist() if n.startswith(IMAGES_PREFIX)]
    for name in names:
        key = name[len(IMAGES_PREFIX):]
        if len(key) != 64 or key.strip("0123456789abcdef"):
            raise BundleError(f"{where}: member {name} is not named by a sha256 digest")
        (directory / "images").mkdir(exist_ok=True)
        _extract(zf, name, directory / "images" / key, {"sha256": key}, where)


def _read_workload(path: Path, where: str) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BundleError(f"{where}: workload.jsonl line {line_no} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("request_id"), int):
                raise BundleError(f"{where}: workload.jsonl line {line_no} has no integer request_id")
            rows.append(row)
    return rows


def _check_db(path: Path, run_id: int, where: str) -> None:
    try:
        conn = sqlite3.connect(read_only_uri(path), uri=True)
        try:
            run_ids = [r[0] for r in conn.execute("SELECT run_id FROM runs")]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise BundleError(f"{where}: telemetry.db is not a readable telemetry store ({exc})") from None
    if run_ids != [run_id]:
        raise BundleError(f"{where}: telemetry.db holds runs {run_ids}, manifest.json says run {run_id}")


def open_bundle(path: str | os.PathLike) -> Bundle:
    """Validate and extract a bundle; ``BundleError`` names what is wrong. Close the result (or use ``with``)."""
    path = Path(path)
    where = f"bundle {path}"
    if not path.is_file():
        raise BundleError(f"{where} does not exist")
    if not zipfile.is_zipfile(path):
        raise BundleError(f"{where} is not a zip file (corrupted or not a Chunkscope bundle)")
    directory = Path(tempfile.mkdtemp(prefix="chunkscope-bundle-"))
    try:
        try:
            with zipfile.ZipFile(path) as zf:
                missing = [n for n in BUNDLE_MEMBERS if n not in set(zf.namelist())]
                if missing:
                    raise BundleError(f"{where} is missing {', '.join(missing)}")
                manifest = _read_manifest(zf, where)
                for name in BUNDLE_MEMBERS:
                    _extract(zf, name, directory / name, manifest["files"].get(name), where)
                _extract_images(zf, directory, where)
        except zipfile.BadZipFile as exc:
            raise BundleError(f"{where} is corrupted: {exc}") from None
        run_id = manifest["run"]["run_id"]
        _check_db(directory / "telemetry.db", run_id, where)
        restore_indexes(directory / "telemetry.db")
        levers = manifest["levers"]
        if not isinstance(levers.get("start"), dict) or not isinstance(levers.get("changes"), list):
            raise BundleError(f"{where}: manifest.json 'levers' needs a 'start' object and a 'changes' list")
        bundle = Bundle(path=path, directory=directory, manifest=manifest,
                        workload=_read_workload(directory / "workload.jsonl", where), lever_timeline=levers,
                        db_path=directory / "telemetry.db", trace_path=directory / "trace.json.gz",
                        workload_path=directory / "workload.jsonl",
                        summary_md=(directory / "summary.md").read_text(encoding="utf-8", errors="replace"))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    weakref.finalize(bundle, shutil.rmtree, str(directory), True)
    return bundle
