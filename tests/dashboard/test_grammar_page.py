"""The Requests page's grammar marks and strip, on a real served run with grammar requests.

Expected numbers come from the store with plain SQL, never through the dashboard's queries."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from plotly_spec import texts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def grammar_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("grammar-run")
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                           "--requests", "30", "--rate", "40", "--grammar-share", "0.5", "--kv-blocks", "40",
                           "--ssm-slots", "8", "--seed", "4"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def sql(run_dir: Path, query: str):
    conn = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


def test_requests_page_marks_grammar_requests_and_validation(app, grammar_run):
    at = app("requests", run_dir=grammar_run, run_id=None)
    (num, num_valid), = sql(grammar_run, "SELECT count(*), sum(grammar_valid = 1) FROM requests "
                                         "WHERE grammar_kind IS NOT NULL")
    assert num >= 8
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["grammar requests"] == str(num)
    assert metrics["output validated"] == f"{num_valid} / {num}"
    (mask_ns, tick_ns), = sql(grammar_run, "SELECT sum(grammar_mask_ns), sum(duration_ns) FROM ticks")
    assert metrics["mask share of tick time"] == f"{mask_ns / tick_ns:.1%}"
    (with_skips, total), = sql(grammar_run, "SELECT sum(num_grammar_skipped > 0), count(*) FROM preemptions")
    assert metrics["preemptions that skipped holders"] == f"{with_skips or 0} / {total}"

    table = at.dataframe[0].value
    expected = dict(sql(grammar_run, "SELECT request_id, grammar_kind || CASE grammar_valid WHEN 1 THEN ' ✓' "
                                     "WHEN 0 THEN ' ✗' ELSE ' …' END || CASE WHEN grammar_valid = 0 AND "
                                     "finish_reason = 'length' THEN ' ✂' ELSE '' END FROM requests"))
    for request_id, mark in zip(table["request_id"], table["grammar"]):
        assert (mark or None) == expected[int(request_id)]
    assert any(table["grammar"].str.endswith("✓"))
    by_kind = at.dataframe[1].value
    assert int(by_kind["requests"].sum()) == num


def test_a_run_without_grammars_says_so(app):
    at = app("requests")
    assert "No request in this run carries a grammar" in texts(at)
