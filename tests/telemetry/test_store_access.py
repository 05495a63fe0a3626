"""How readers and the writer touch the SQLite file: read-only URIs (a read-only directory, with or without
WAL content), the writer's WAL checkpoints (skipped when idle, TRUNCATE past the limit), the snapshot's time
window, and the pid checks behind crashed-run marking."""
from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from telemetry import ro_uri
from telemetry.procs import is_engine_pid, is_pid_alive
from telemetry.snapshot import MAX_WINDOW_S, SnapshotError, TimeWindow, latest_run_id, take_snapshot
from telemetry.wal_checkpoint import WalCheckpointer


def wal_store(path: Path, rows: int) -> sqlite3.Connection:
    """A WAL-mode store with ``rows`` committed rows still in its -wal (no checkpoint yet)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    for i in range(rows):
        conn.execute("INSERT INTO t VALUES (?)", [i])
    return conn


def count_rows(uri: str) -> int:
    conn = sqlite3.connect(uri, uri=True)
    try:
        return conn.execute("SELECT count(*) FROM t").fetchone()[0]
    finally:
        conn.close()


@pytest.fixture
def read_only_dir(monkeypatch, tmp_path):
    """The store's directory reads as not writable (tests run as root, where chmod would not bite)."""
    copies = tmp_path / "copies"
    monkeypatch.setattr(ro_uri, "COPY_ROOT", copies)
    real_access = os.access
    monkeypatch.setattr(ro_uri.os, "access",
                        lambda p, mode: False if mode == os.W_OK and Path(p) == tmp_path / "store" else
                        real_access(p, mode))
    (tmp_path / "store").mkdir()
    return tmp_path / "store", copies


def test_a_writable_directory_gets_a_plain_read_only_uri(tmp_path):
    db = tmp_path / "a b%.db"
    wal_store(db, 3).close()
    uri = ro_uri.read_only_uri(db)
    assert uri.endswith("?mode=ro") and "immutable" not in uri and "a%20b%25.db" in uri
    assert count_rows(uri) == 3
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        sqlite3.connect(uri, uri=True).execute("INSERT INTO t VALUES (1)")


def test_a_read_only_directory_without_wal_content_opens_immutable(read_only_dir):
    directory, copies = read_only_dir
    db = directory / "telemetry.db"
    conn = wal_store(db, 4)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    uri = ro_uri.read_only_uri(db)
    assert uri.endswith("&immutable=1") and count_rows(uri) == 4
    assert not copies.exists(), "nothing to recover: no copy"


def test_a_read_only_directory_with_wal_content_reads_a_private_copy(read_only_dir):
    directory, copies = read_only_dir
    db = directory / "telemetry.db"
    writer = wal_store(db, 5)       # held open: the -wal keeps its 5 rows, as after a killed engine
    try:
        assert (directory / "telemetry.db-wal").stat().st_size > 0
        uri = ro_uri.read_only_uri(db)
        assert str(copies) in uri and "immutable" not in uri
        assert count_rows(uri) == 5, "the copy recovers the WAL's rows"
        assert ro_uri.read_only_uri(db) == uri, "the same version is copied once"
        assert oct(copies.stat().st_mode & 0o777) == "0o700"
        writer.execute("INSERT INTO t VALUES (99)")
        newer = ro_uri.read_only_uri(db)
        assert newer != uri and count_rows(newer) == 6, "a grown WAL is a new version"
    finally:
        writer.close()


def test_the_checkpointer_skips_when_idle_and_truncates_past_the_limit(tmp_path):
    db = tmp_path / "w.db"
    conn = wal_store(db, 50)
    wal = Path(str(db) + "-wal")
    try:
        small = WalCheckpointer(str(db), interval_s=0.0, wal_limit_bytes=1 << 30)
        small.maybe_run(conn, flushed_batches=1)
        assert small.num_checkpoints == 1 and wal.stat().st_size > 0, "PASSIVE copies frames, keeps the file"
        small.maybe_run(conn, flushed_batches=1)
        assert small.num_checkpoints == 1, "nothing committed since a complete checkpoint: skipped"
        conn.execute("INSERT INTO t VALUES (1)")
        small.maybe_run(conn, flushed_batches=2)
        assert small.num_checkpoints == 2
        tight = WalCheckpointer(str(db), interval_s=0.0, wal_limit_bytes=1)
        assert tight.run(conn) is True and wal.stat().st_size == 0, "past the limit: TRUNCATE"
        assert tight.run(None) is False, "no connection (the writer failed): nothing done"
        waiting = WalCheckpointer(str(db), interval_s=3600.0, wal_limit_bytes=1)
        waiting.maybe_run(conn, flushed_batches=9)
        assert waiting.num_checkpoints == 0, "not due yet"
    finally:
        conn.close()
    assert count_rows(f"file:{db}?mode=ro") == 51


def test_time_windows_check_their_bounds_in_seconds():
    window = TimeWindow.from_seconds(1.5, 2.0)
    assert (window.since_ns, window.until_ns, window.is_windowed) == (1_500_000_000, 2_000_000_000, True)
    assert not TimeWindow.from_seconds(None, None).is_windowed
    assert TimeWindow.from_seconds(None, 0.25).until_ns == 250_000_000
    for since, until, words in [(-1.0, None, "since must be >= 0 s, got -1 s"),
                                (3.0, 3.0, "until (3 s) is not after since (3 s)"),
                                (float("nan"), None, "since nan s is not a time within a run"),
                                (None, MAX_WINDOW_S * 2, "until 1.84e+10 s is not a time within a run")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            TimeWindow.from_seconds(since, until)


def test_snapshot_refuses_what_it_cannot_copy(tmp_path):
    with pytest.raises(SnapshotError, match="does not exist"):
        take_snapshot(tmp_path / "missing.db", 1, tmp_path / "out.db")
    (tmp_path / "junk.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(SnapshotError, match="cannot be read"):
        latest_run_id(tmp_path / "junk.db")
    store = tmp_path / "store.db"
    conn = sqlite3.connect(store)
    conn.execute("CREATE TABLE runs (run_id INTEGER PRIMARY KEY)")
    conn.execute("INSERT INTO runs VALUES (4)")
    conn.commit()
    conn.close()
    assert latest_run_id(store) == 4
    with pytest.raises(SnapshotError, match="no run 5 in"):
        take_snapshot(store, 5, tmp_path / "out.db")
    (tmp_path / "taken.db").write_text("")
    with pytest.raises(SnapshotError, match="already exists"):
        take_snapshot(store, 4, tmp_path / "taken.db")


def test_pid_checks_tell_live_dead_and_recycled_pids():
    assert is_pid_alive(os.getpid())
    for pid in (0, -3, True, "123", None, 1.5):
        assert not is_pid_alive(pid) and not is_engine_pid(pid)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not is_pid_alive(int(done.stdout))
    # Each child says "ready" once it runs its own command line (before exec, /proc shows pytest's).
    ready = "import time; print('ready', flush=True); time.sleep(30)"
    sleeper = subprocess.Popen([sys.executable, "-c", ready], stdout=subprocess.PIPE, text=True)
    engine = subprocess.Popen([sys.executable, "-c", ready, "-m", "engine", "serve"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert sleeper.stdout.readline() == engine.stdout.readline() == "ready\n"
        assert is_pid_alive(sleeper.pid) and not is_engine_pid(sleeper.pid), "alive, but not the engine"
        assert is_engine_pid(engine.pid)
    finally:
        for child in (sleeper, engine):
            child.kill()
            child.wait()
            child.stdout.close()
