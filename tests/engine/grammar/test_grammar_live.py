"""A live served run with grammar requests under a small KV cap: holders never preempted (the rows
show the skips), outputs valid, per-tick grammar counters, and a replay of its bundle that is
decision- and token-identical."""
from __future__ import annotations

import json
import re
import sqlite3
import zipfile

import jsonschema
import pytest

from engine.replay.rerun import load_input, replay_run
from engine.replay.compare import compare
from telemetry.bundle_export import export_bundle

from grammar_helpers import tiny
from serve_process import kill_quietly, start_serve

SERVE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grammar-served")
    # Every request arrives at once (rate 1000/s; serve feeds arrivals by wall time): they overflow the
    # 40 blocks and preempt on any machine speed (at 40/s a fast CPU finished them before the cap bit).
    proc = start_serve(run_dir, "--requests", "60", "--rate", "1000", "--grammar-share", "0.5",
                       "--kv-blocks", "40", "--ssm-slots", "8", "--seed", "3")
    try:
        assert proc.wait(timeout=SERVE_TIMEOUT_S) == 0, (run_dir / "serve.stderr").read_text()[-2000:]
    finally:
        kill_quietly(proc)
    return run_dir


def rows(run_dir, sql):
    conn = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql)]
    finally:
        conn.close()


def test_holders_are_never_preempted_and_their_outputs_validate(served):
    requests = rows(served, "SELECT * FROM requests")
    holders = [r for r in requests if r["grammar_kind"]]
    assert len(holders) >= 15 and len(requests) == 60
    preemptions = rows(served, "SELECT * FROM preemptions")
    assert len(preemptions) >= 3, "the KV cap forced no preemptions: the run proves nothing"
    held = {r["request_id"] for r in holders}
    assert not {p["victim_request_id"] for p in preemptions} & held
    assert any(p["num_grammar_skipped"] > 0 for p in preemptions)
    model, tokenizer = tiny()
    for holder in holders:
        assert holder["status"] == "finished" and holder["finish_reason"] == "stop", holder["error"]
        assert holder["grammar_valid"] == 1
        grammar = json.loads(holder["grammar"])
        text = tokenizer.decode([t for t in json.loads(holder["output_tokens"]) if t != model.eos_token_id])
        if grammar["kind"] == "json_schema":
            jsonschema.validate(json.loads(text), grammar["value"])
        elif grammar["kind"] == "regex":
            assert re.fullmatch(grammar["value"], text)
        else:
            assert text in grammar["value"]
    assert all(r["grammar_valid"] is None for r in requests if not r["grammar_kind"])


def test_ticks_count_constrained_rows_and_mask_time(served):
    ticks = rows(served, "SELECT num_constrained_rows, grammar_mask_ns FROM ticks")
    constrained = [t for t in ticks if t["num_constrained_rows"]]
    assert len(constrained) > 20 and all(t["grammar_mask_ns"] > 0 for t in constrained)
    assert all(t["grammar_mask_ns"] == 0 for t in ticks if not t["num_constrained_rows"])


def test_the_bundle_carries_the_grammars_and_replays_identically(served):
    bundle = export_bundle(served / "telemetry.db", served / "bundle.zip").path
    with zipfile.ZipFile(bundle) as archive:
        lines = [json.loads(line) for line in archive.read("workload.jsonl").decode().splitlines()]
    assert sum(1 for line in lines if line.get("grammar")) >= 15
    recorded, _ = load_input(str(bundle))
    replayed = replay_run(recorded, model="tiny")
    report = compare(recorded, replayed)
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"] and report["statuses_identical"]
