"""The bundle recorded before the tick became a pipeline of stages (``tests/fixtures/pipeline_run.py``,
issue 30) replays decision- and token-identical, and the same run recorded again today writes the
same telemetry rows, every table, everything but the clock.

The run covers every tick path: mixed, plain and decode ticks, preemptions, a mixed forward that
found no blocks, prefix hits and SSM snapshots, the speculative step with dropped drafts, grammar
requests, first-token rules, a cancelled client, and one failing forward of each kind.
"""
from __future__ import annotations

import json
import re
import sqlite3
import sys
import zipfile
from pathlib import Path

import pytest

from engine.model.embedded import EMBEDDED_MODELS, checkpoint_dir_of
from engine.replay.compare import compare
from engine.replay.rerun import load_input, replay_run
from engine.serve.engine_setup import checkpoint_hash
from telemetry import events as ev

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
sys.path.insert(0, str(FIXTURES))
import pipeline_run  # noqa: E402

# Columns that hold the clock (and the table's own keys), not what the engine decided.
CLOCK_COLUMN = re.compile(r"(^id$|^run_id$|_ns$|_ms$)")
CLOCK_DETAIL_KEY = re.compile(r"(_ns$|_ms$|_s$|^where$)")   # "where": the file:line of a raised fault
MILLISECONDS = re.compile(r"\d+(\.\d+)? ms")                 # "compiled in 0.41 ms"


@pytest.fixture(scope="module")
def bundle():
    recorded, manifest = load_input(str(pipeline_run.BUNDLE))
    model = next((name for name in EMBEDDED_MODELS
                  if checkpoint_hash(checkpoint_dir_of(name)) == recorded.checkpoint_hash), None)
    assert model is not None, ("no embedded model has the checkpoint the fixture was recorded on: the "
                               "seeded random 'tiny' must stay available by name (regenerating the bundle "
                               "would lose what it proves)")
    return recorded, manifest, model


def cpu_note(recorded) -> str:
    return (f"recorded with {recorded.config.get('dtype')} on a CPU with {recorded.config.get('cpu_isa')}: "
            f"a CPU whose kernels round differently computes other tokens")


def test_the_fixture_exercises_every_tick_path(bundle):
    recorded, _, _ = bundle
    paths = {t.path for t in recorded.ticks}
    outcomes = {c.outcome for c in recorded.chunks}
    statuses = {r.status for r in recorded.requests}
    assert paths == {ev.PATH_MIXED, ev.PATH_PREFILL, ev.PATH_DECODE}
    assert {ev.OUTCOME_OK, ev.OUTCOME_MIXED_KV_FALLBACK, ev.OUTCOME_FAILED_FORWARD} <= outcomes
    assert {ev.REQ_FINISHED, ev.REQ_PREEMPTED, ev.REQ_ERROR, ev.REQ_CANCELLED} <= statuses
    assert sum(r.prefix_hit_tokens for r in recorded.requests) > 0
    assert {c.name for c in recorded.lever_changes} >= {"speculation", "bisect_no_mix", "kv_blocks_cap",
                                                        "max_prefill_tokens", "always_mixed"}


def test_replay_is_decision_and_token_identical(bundle):
    recorded, _, model = bundle
    report = compare(recorded, replay_run(recorded, model=model))
    assert report["decisions_identical"] and report["tokens_identical"], (
        f"first divergence {report['first_divergence']} ({cpu_note(recorded)})")
    assert all(r["status_identical"] for r in report["requests"])


def _rows(db: sqlite3.Connection, table: str) -> list[dict]:
    columns = [c[1] for c in db.execute(f"PRAGMA table_info([{table}])")]
    order = "request_id" if table == "requests" else "id"
    rows = []
    for values in db.execute(f"SELECT * FROM [{table}] ORDER BY {order}"):
        row = {c: v for c, v in zip(columns, values) if not CLOCK_COLUMN.search(c)}
        for key, value in row.items():
            if isinstance(value, str) and value.startswith("{"):
                try:
                    detail = json.loads(value)
                except ValueError:
                    continue
                row[key] = {k: v for k, v in detail.items() if not CLOCK_DETAIL_KEY.search(k)}
            elif isinstance(value, str):
                row[key] = MILLISECONDS.sub("N ms", value)
        rows.append(row)
    return rows


def test_recording_again_writes_the_same_rows(bundle, tmp_path):
    recorded, _, model = bundle
    with zipfile.ZipFile(pipeline_run.BUNDLE) as archive:
        archive.extract("telemetry.db", tmp_path / "bundle")
    fresh = pipeline_run.record(tmp_path / "telemetry.db", model=model)
    before, after = sqlite3.connect(tmp_path / "bundle" / "telemetry.db"), sqlite3.connect(fresh)
    try:
        for cls in ev.EVENT_TYPES:
            old, new = _rows(before, cls.TABLE), _rows(after, cls.TABLE)
            # Columns added to events.py since the bundle was recorded are additive (telemetry/schema.py):
            # the rows must agree on the columns the bundle has.
            new = [{k: v for k, v in row.items() if k in old[0]} for row in new] if old else new
            assert old, f"{cls.TABLE}: the bundle holds no rows"
            # A column added since the bundle was recorded (chunks.slice_budget_ignored) is not in its rows.
            new = [{k: v for k, v in row.items() if k in old[0]} for row in new]
            first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            assert old == new, (f"{cls.TABLE}: {len(old)} rows recorded, {len(new)} now; first difference at "
                                f"row {first}: {old[first:first + 1]} vs {new[first:first + 1]} ({cpu_note(recorded)})")
    finally:
        before.close()
        after.close()
