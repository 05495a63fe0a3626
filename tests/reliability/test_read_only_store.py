"""A WAL-mode store in a read-only directory (a read-only mount) is readable by every reader:
the CLI (runs, summary, export), the dashboard, the replay loader. Root mounts a tmpfs and
remounts it read-only; elsewhere the test skips."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from telemetry.__main__ import main as telemetry_main
from telemetry.reader import TelemetryReader

sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))
import synthetic_run  # noqa: E402

from test_store_faults import tmpfs  # noqa: E402,F401  (fixture)


def _remount_read_only(directory: Path) -> None:
    result = subprocess.run(["mount", "-o", "remount,ro", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot remount read-only: {result.stderr.strip()}")


def _store(tmp_path: Path) -> Path:
    db = tmp_path / "source.db"
    synthetic_run.write_run(db, synthetic_run.SimConfig(num_requests=4))
    return db


def test_clean_wal_store_in_a_read_only_dir(tmp_path, tmpfs, capsys, monkeypatch):  # noqa: F811
    run_dir = tmpfs("ro")
    shutil.copy(_store(tmp_path), run_dir / "telemetry.db")
    _remount_read_only(run_dir)
    db = str(run_dir / "telemetry.db")
    assert telemetry_main(["runs", "--db", db]) == 0
    assert "finished" in capsys.readouterr().out
    assert telemetry_main(["summary", "--db", db, "--json"]) == 0
    assert '"run_id": 1' in capsys.readouterr().out
    assert telemetry_main(["export", "--db", db, "-o", str(tmp_path / "b.zip")]) == 0, capsys.readouterr().err
    from streamlit.testing.v1 import AppTest

    app = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
    monkeypatch.setenv("CHUNKSCOPE_RUN_DIR", str(run_dir))
    at = AppTest.from_file(app, default_timeout=30)
    at.run()
    shown = [m.value for m in [*at.warning, *at.error, *at.info]]
    assert not at.exception and not at.error and not any("unable to open" in m for m in shown), shown
    assert at.metric, "the Live page drew no counters"


def test_wal_with_uncheckpointed_rows_in_a_read_only_dir_is_read_in_full(tmp_path, tmpfs):  # noqa: F811
    run_dir = tmpfs("ro")
    db = run_dir / "telemetry.db"
    shutil.copy(_store(tmp_path), db)
    # A writer that dies before any checkpoint: its last commit lives only in telemetry.db-wal.
    subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sqlite3
        conn = sqlite3.connect({str(db)!r})
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("UPDATE runs SET model = 'only-in-the-wal'")
        conn.commit()
        os._exit(0)
        """)], check=True)
    assert (run_dir / "telemetry.db-wal").stat().st_size > 0
    _remount_read_only(run_dir)
    runs = TelemetryReader(db).list_runs()
    assert [r["model"] for r in runs] == ["only-in-the-wal"]
