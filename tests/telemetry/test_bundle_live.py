"""Export a run while the engine is still writing it: the snapshot is consistent and the zip complete."""
from __future__ import annotations

import gzip
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry.bundle import open_bundle
from telemetry.bundle_export import export_bundle
from telemetry.reader import TelemetryReader

from trace_validator import validate_trace

REPO = Path(__file__).resolve().parents[2]


def _wait_for_ticks(db: Path, proc: subprocess.Popen, num_ticks: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    reader = TelemetryReader(db)
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"engine exited early: {proc.stderr.read().decode()[-2000:]}"
        run_id = reader.latest_run_id()
        summary = reader.run_summary(run_id) if run_id else None
        if summary and summary["ticks"] >= num_ticks and summary["output_tokens"] > 0:
            return
        time.sleep(0.2)
    pytest.fail(f"engine wrote fewer than {num_ticks} ticks in {timeout_s} s")


@pytest.fixture
def live_engine(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                             "--rate", "20", "--duration", "8", "--seed", "3"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield run_dir, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _count(db: Path, sql: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchone()[0]
    finally:
        conn.close()


def test_export_while_the_engine_writes(live_engine):
    run_dir, proc = live_engine
    db = run_dir / "telemetry.db"
    _wait_for_ticks(db, proc, num_ticks=10)
    result = export_bundle(db, run_dir / "live.zip", allowed_root=run_dir)
    assert proc.poll() is None, "the export must happen while the engine is still running"
    with open_bundle(result.path) as bundle:
        manifest = bundle.manifest
        assert manifest["run"]["status"] == "running"
        assert manifest["command_line"].startswith("python -m engine serve --model tiny --run-dir . ")
        assert str(run_dir) not in (bundle.directory / "manifest.json").read_text()
        requests = _count(bundle.db_path, "SELECT count(*) FROM requests")
        assert len(bundle.workload) == requests == manifest["counts"]["requests"] > 0
        assert all(w["sampling"].get("max_tokens") and "seed" in w["sampling"] for w in bundle.workload)
        # Consistency of one snapshot: every token row belongs to a request row of the snapshot,
        # and the tick extent in the manifest is the snapshot's.
        assert _count(bundle.db_path, "SELECT count(*) FROM tokens WHERE request_id NOT IN "
                                      "(SELECT request_id FROM requests)") == 0
        assert manifest["time_range"]["last_tick"] == _count(
            bundle.db_path, "SELECT max(m) FROM (SELECT max(tick) AS m FROM ticks UNION ALL "
                            "SELECT max(tick) FROM chunks UNION ALL SELECT max(tick) FROM tokens "
                            "UNION ALL SELECT max(tick) FROM stream_events UNION ALL SELECT max(tick) FROM "
                            "request_events UNION ALL SELECT max(tick) FROM lever_changes UNION ALL "
                            "SELECT max(tick) FROM preemptions UNION ALL SELECT max(tick) FROM events)")
        assert manifest["levers"]["start"]["max_prefill_tokens"] == 256
        trace = json.loads(gzip.decompress(bundle.trace_path.read_bytes()))
        assert validate_trace(trace) == []
        assert any(e.get("flow_out") for e in trace["traceEvents"])
        # The engine's own workload reader accepts the bundle's workload.jsonl.
        from engine.workload.bundle import read_workload_jsonl
        specs = read_workload_jsonl(bundle.workload_path)
        assert [s.request_id for s in specs] == [w["request_id"] for w in bundle.workload]
        snapshot_ticks = manifest["counts"]["ticks"]
    assert proc.wait(timeout=60) == 0
    final = export_bundle(db, run_dir / "final.zip", allowed_root=run_dir)
    assert final.manifest["run"]["status"] == "finished"
    assert final.manifest["counts"]["ticks"] > snapshot_ticks
