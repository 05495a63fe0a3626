"""A real ``serve --kv-cache-dtype innerq4`` run on the Live and Chunks pages: the calibration
state changes on the timeline, the state on every chunk row, KV gauges in tokens and bytes.
Expected values come from plain SQL on the run's database."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from plotly_spec import chart_with, texts

from dashboard.figures.timeline import TIMELINE_UIREVISION
from real_run import ROOT

ARGS = ["--workload", "synthetic", "--requests", "10", "--rate", "40", "--kv-cache-dtype", "innerq4",
        "--kv-calib-tokens", "96", "--kv-cache-mb", "0.25", "--seed", "3"]


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("innerq") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                           *ARGS], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def rows(run_dir, sql):
    conn = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_the_run_row_records_the_cache_format(quant_run):
    config = json.loads(rows(quant_run, "SELECT config FROM runs")[0][0])
    assert config["kv_cache_dtype"] == "innerq4" and config["kv_cache_mb"] == 0.25
    assert config["kv_cache_bytes"] == 2 ** 18 and config["kv_calib_tokens"] == 96


def test_live_timeline_marks_each_calibration_state_change(quant_run, app):
    at = app(run_dir=quant_run, run_id=None)
    at.select_slider(key="live_window_s").set_value(300).run()
    changes = rows(quant_run, "SELECT json_extract(detail, '$.new') FROM events WHERE kind = 'kv_quant_state' "
                              "ORDER BY id")
    assert [c[0] for c in changes] == ["ready", "applied"]
    spec = chart_with(at, uirevision=TIMELINE_UIREVISION)
    marker = next(t for t in spec["data"] if t["name"] == "KV quant state")
    assert marker["text"] == ["ready", "applied"]
    tick = rows(quant_run, "SELECT tick FROM events WHERE kind = 'kv_quant_state' ORDER BY id DESC")[0][0]
    assert f"KV cache innerq4: applied since tick {tick}" in texts(at)
    last = rows(quant_run, "SELECT kv_tokens_used, kv_tokens_total, kv_bytes_used, kv_bytes_total FROM ticks "
                           "ORDER BY tick DESC LIMIT 1")[0]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["KV tokens"] == f"{last[0]:,} / {last[1]:,}"
    assert metrics["KV MiB"] == f"{last[2] / 2 ** 20:.1f} / {last[3] / 2 ** 20:.1f}"
    assert rows(quant_run, "SELECT COUNT(*) FROM ticks WHERE kv_bytes_used > kv_bytes_total "
                           "OR kv_bytes_total != 262144")[0][0] == 0, "the byte budget holds on every tick"


def test_every_chunk_row_carries_the_state_it_saw(quant_run, app):
    counts = dict(rows(quant_run, "SELECT kv_quant_state, COUNT(*) FROM chunks GROUP BY kv_quant_state"))
    assert set(counts) == {"calibrating", "ready", "applied"} and counts["ready"] == 1
    at = app("chunks", run_dir=quant_run, run_id=None)
    table = next(df.value for df in at.dataframe if "kv_quant_state" in df.value.columns)
    assert set(table["kv_quant_state"]) <= set(counts) and "applied" in set(table["kv_quant_state"])
