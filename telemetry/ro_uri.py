"""The SQLite URI every reader opens a store with: ``mode=ro``, and still readable in a read-only directory.

A WAL-mode store needs its ``-shm`` file, which SQLite creates beside the
database even for a read-only connection; in a read-only directory (a
read-only mount, a copied run dir) that fails with "unable to open database
file". No engine can be writing there, so:

* no ``-wal`` content -> open with ``immutable=1`` (SQLite skips the lock and
  shm files; nothing is lost because nothing sits in a WAL);
* a non-empty ``-wal`` (an engine killed before a checkpoint) -> copy the
  database and its WAL once to a private temp directory (keyed by their sizes
  and mtimes) and read the copy, where SQLite may recover the WAL.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.parse
from pathlib import Path

COPY_ROOT = Path(tempfile.gettempdir()) / f"chunkscope-ro-copies-{os.getuid()}"


def read_only_uri(path: str | os.PathLike) -> str:
    """``file:...?mode=ro`` for ``path``, made to work when its directory is not writable."""
    path = Path(path).resolve()
    if os.access(path.parent, os.W_OK) or not path.is_file():
        return _uri(path)
    wal = path.with_name(path.name + "-wal")
    if not wal.exists() or wal.stat().st_size == 0:
        return _uri(path) + "&immutable=1"
    return _uri(_private_copy(path, wal))


def _uri(path: Path) -> str:
    return "file:" + urllib.parse.quote(str(path)) + "?mode=ro"


def _private_copy(db: Path, wal: Path) -> Path:
    """The database and its WAL copied once per version into a 0700 temp directory."""
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in (db, wal)]
    key = hashlib.sha256(f"{db}:{stats}".encode()).hexdigest()[:16]
    target = COPY_ROOT / key
    copy = target / db.name
    if copy.exists():
        return copy
    COPY_ROOT.mkdir(mode=0o700, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=COPY_ROOT))
    shutil.copy2(db, staging / db.name)
    shutil.copy2(wal, staging / wal.name)
    try:
        os.replace(staging, target)     # atomic: a concurrent reader sees no half copy
    except OSError:                      # another reader won the race: its copy is the same
        shutil.rmtree(staging, ignore_errors=True)
    return copy
