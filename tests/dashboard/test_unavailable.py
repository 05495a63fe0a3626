"""A missing, half-written, locked or non-SQLite store shows a clear state on every page, never a trace."""
import sqlite3
import threading

import pytest

PAGES = [None, "chunks", "requests", "levers", "runs"]


def _messages(at):
    return " ".join(m.value for m in list(at.info) + list(at.warning))


@pytest.mark.parametrize("page", PAGES)
def test_missing_database(app, tmp_path, page):
    at = app(page, run_dir=tmp_path, run_id=None)
    assert "No telemetry database" in _messages(at)


@pytest.mark.parametrize("page", PAGES)
def test_half_written_database(app, tmp_path, page):
    conn = sqlite3.connect(tmp_path / "telemetry.db")
    conn.execute("CREATE TABLE runs (run_id INTEGER PRIMARY KEY, status TEXT, num_events INT)")
    conn.execute("INSERT INTO runs VALUES (1, 'running', 0)")
    conn.commit()
    conn.close()
    at = app(page, run_dir=tmp_path, run_id=None)
    assert "incomplete" in _messages(at)


@pytest.mark.parametrize("page", PAGES)
def test_not_a_database(app, tmp_path, page):
    (tmp_path / "telemetry.db").write_bytes(b"this is not sqlite at all" * 100)
    at = app(page, run_dir=tmp_path, run_id=None)
    assert "not a readable telemetry database" in _messages(at)


def test_empty_file_is_being_created(app, tmp_path):
    (tmp_path / "telemetry.db").write_bytes(b"")
    at = app(None, run_dir=tmp_path, run_id=None)
    assert "empty" in _messages(at)


def test_locked_database(app, tmp_path, run_fixture):
    """A writer holding an exclusive lock (rollback journal) makes reads busy: say so."""
    db = tmp_path / "telemetry.db"
    db.write_bytes(run_fixture.db.read_bytes())
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("BEGIN EXCLUSIVE")
    try:
        at = app("chunks", run_dir=tmp_path, run_id=None)
        assert "busy" in _messages(at) or "locked" in _messages(at)
    finally:
        conn.execute("ROLLBACK")
        conn.close()
