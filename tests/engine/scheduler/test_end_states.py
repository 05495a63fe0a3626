"""Every request's end is counted, everywhere, from one real engine run.

The run has finished, error (the test fault hook), preempted (a small KV cache), rejected (a bad
field) and cancelled (``Scheduler.cancel``) requests. The CLI summary (text and ``--json``), the run
totals on the runs row and the bundle's summary.md must each report every end state on its own with
the numbers of ``SELECT status, count(*) FROM requests GROUP BY status``, and ``errors`` must be the
sum of the failure states.
"""
from __future__ import annotations

import json
import sqlite3

import pytest

from engine.model.fault import ForwardFault
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.__main__ import main as telemetry_cli
from telemetry.bundle import open_bundle
from telemetry.bundle_export import export_bundle
from telemetry.levers import defaults
from telemetry.writer import TelemetryWriter

PREEMPTING = [(0, list(range(1, 120)), {"max_tokens": 40}), (1, list(range(5, 40)), {"max_tokens": 40}),
              (2, list(range(7, 200)), {"max_tokens": 8})]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A finished run with every end state, written by the real writer."""
    model, _, _ = load_model("tiny")
    db_path = tmp_path_factory.mktemp("end_states") / "telemetry.db"
    levers = defaults().replace(bisect_no_mix=True, max_prefill_tokens=32)
    runner = ModelRunner.build(model, num_kv_blocks=18, num_ssm_slots=8, fault=ForwardFault.parse("4:prefill"))
    writer = TelemetryWriter(db_path)
    writer.start_run(ev.RunStarted(started_at=0.0, model="tiny", device="cpu", config={}, model_config={},
                                   versions={}, workload={}, levers=levers.as_dict()))
    sched = Scheduler(runner, levers, emit=writer.emit)
    pending = PREEMPTING + [(3, [1, 2, 3], {"max_tokens": 0}), (4, list(range(9, 30)), {"max_tokens": 4}),
                            (5, list(range(11, 20)), {"max_tokens": 4}), (6, list(range(13, 25)), {"max_tokens": 3})]
    while pending or sched.has_work:
        if pending and sched.tick % 4 == 0:
            request = sched.submit(*pending.pop(0))
            if request.request_id == 5:
                sched.cancel(5, "client went away")
        if not sched.step() and pending:
            sched.submit(*pending.pop(0))
    writer.close("finished")
    return db_path


def grouped(db_path) -> dict[str, int]:
    conn = sqlite3.connect(db_path)
    try:
        return dict(conn.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())
    finally:
        conn.close()


def test_the_run_has_every_end_state(store):
    assert set(grouped(store)) == {ev.REQ_FINISHED, ev.REQ_ERROR, ev.REQ_PREEMPTED, ev.REQ_REJECTED,
                                   ev.REQ_CANCELLED}


def test_summary_json_has_one_key_per_state_and_errors_is_the_failure_sum(store, capsys):
    assert telemetry_cli(["summary", "--db", str(store), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    counts = grouped(store)
    assert {status: summary[status] for status in counts} == counts
    assert {status: summary[status] for status in ev.END_STATUSES if status not in counts} == \
        dict.fromkeys(set(ev.END_STATUSES) - set(counts), 0)
    assert summary["running"] == 0 and summary["requests"] == sum(counts.values())
    assert summary["errors"] == sum(counts.get(s, 0) for s in ev.FAILURE_STATUSES) > counts[ev.REQ_ERROR]


def test_summary_text_prints_each_state(store, capsys):
    assert telemetry_cli(["summary", "--db", str(store)]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    counts = grouped(store)
    for status, n in counts.items():
        assert lines[status] == str(n)
    failures = sum(counts.get(s, 0) for s in ev.FAILURE_STATUSES)
    assert lines["errors"] == f"{failures}  (error + preempted + rejected)"


def test_run_totals_count_each_state(store):
    conn = sqlite3.connect(store)
    conn.row_factory = sqlite3.Row
    row = dict(conn.execute("SELECT * FROM runs").fetchone())
    conn.close()
    counts = grouped(store)
    for status in ev.END_STATUSES:
        assert row[f"num_{status}_requests"] == counts.get(status, 0), status
    assert row["num_running_requests"] == 0 and row["num_requests"] == sum(counts.values())


def test_bundle_summary_md_counts_each_state(store, tmp_path):
    result = export_bundle(store, tmp_path / "bundle.zip")
    with open_bundle(result.path) as bundle:
        text = bundle.summary_md
    counts = grouped(store)
    for status in ev.END_STATUSES:
        assert f"| {status} | {counts.get(status, 0)} |" in text
    assert f"| errors | {sum(counts.get(s, 0) for s in ev.FAILURE_STATUSES)} |" in text
    assert "| chunk | chunk outcome failed_forward | 1 | 4 |" in text
    errors = text[text.index("## Errors"):text.index("## Lever changes")]
    assert "client went away" not in errors  # a cancel is not a failure
    assert "injected fault" in errors and "preempted: KV cache exhausted" in errors


def test_the_failure_states_are_the_ones_the_sql_lists():
    # summary_md.py and dashboard/queries/requests.py filter with this literal list.
    assert ev.FAILURE_STATUSES == ("error", "preempted", "rejected")
