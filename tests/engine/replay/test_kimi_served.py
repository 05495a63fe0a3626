"""A served tiny-kimi run (multi-turn, a small cache): the whole-prompt caps with mla_chunked_prefill
off, plain chunks once the levers file flips it on, preemptions, and a replay identical tick for tick."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dashboard.panels.kv_gauges import kv_kind_caption
from engine.replay.compare import compare
from engine.replay.rerun import load_input, replay_run, resolve_model
from telemetry import events as ev
from telemetry.bundle_export import export_bundle
from telemetry.levers import write_levers_file

from serve_process import kill_quietly, max_tick, query, scalar, start_serve, stop, wait_for


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kimi")
    db = run_dir / "telemetry.db"
    proc = start_serve(run_dir, "--model", "tiny-kimi", "--workload", "multiturn", "--rate", "20", "--seed", "2",
                       "--kv-blocks", "40", "--dtype", "float32",
                       env_extra={"CHUNKSCOPE_MAX_PREFILL_TOKENS": "48", "CHUNKSCOPE_ALWAYS_MIXED": "1",
                                  "CHUNKSCOPE_SLICE_BUDGET": "32"})
    try:
        wait_for(lambda: (scalar(db, f"SELECT count(*) FROM chunks WHERE cap_rule = '{ev.CAP_WHOLE_PROMPT}'") or 0) >= 3
                 and scalar(db, "SELECT count(*) FROM preemptions"), "whole-prompt caps and a preemption", proc)
        write_levers_file(run_dir / "levers.json", 1, {"mla_chunked_prefill": True})
        change = wait_for(lambda: query(db, "SELECT * FROM lever_changes WHERE name = 'mla_chunked_prefill' "
                                            "AND status = 'applied'"), "the flip", proc)[0]
        wait_for(lambda: (scalar(db, "SELECT count(*) FROM chunks WHERE tick > ? AND is_last = 0",
                                 (change["tick"],)) or 0) >= 3
                 and max_tick(db) >= change["tick"] + 30, "chunked MLA prompts after the flip", proc)
        status, stderr = stop(proc)
    finally:
        kill_quietly(proc)
    assert status == 0, stderr
    return SimpleNamespace(db=db, change=change, bundle=export_bundle(db, run_dir / "bundle.zip").path)


def test_the_rule_then_the_flip_show_in_the_chunk_rows(served):
    tick = served.change["tick"]
    before = query(served.db, "SELECT * FROM chunks WHERE tick < ?", (tick,))
    after = query(served.db, "SELECT * FROM chunks WHERE tick > ?", (tick,))
    assert all(c["offset"] == 0 or c["offset"] == _prefix_hit(served.db, c["request_id"]) for c in before)
    capped = [c for c in before if c["cap_rule"] == ev.CAP_WHOLE_PROMPT]
    assert capped and all(c["is_last"] and c["slice_budget_ignored"] for c in capped)
    assert any(c["length"] > 32 for c in capped)  # past the slice budget
    assert not any(c["cap_rule"] == ev.CAP_WHOLE_PROMPT for c in after)
    assert all(c["length"] <= 32 and not c["slice_budget_ignored"] for c in after)
    assert any(not c["is_last"] for c in after)
    assert scalar(served.db, "SELECT count(*) FROM preemptions") > 0
    run = query(served.db, "SELECT model, config FROM runs")[0]
    assert run["model"] == "tiny-kimi"
    # The Live page says which KV the gauges count (dashboard/panels/kv_gauges.py, pure).
    caption = kv_kind_caption(json.loads(run["config"]))
    assert caption == "; KV cache: MLA latent rows, 80 values per token and layer (per-head K/V: 320, 4.0x)"
    assert kv_kind_caption({"kv_kind": "per_head", "kv_values_per_token_layer": 128}) == ""


def _prefix_hit(db, request_id: int) -> int:
    return scalar(db, "SELECT prefix_hit_tokens FROM requests WHERE request_id = ?", (request_id,)) or 0


def test_the_served_run_replays_identically(served):
    recorded, _ = load_input(str(served.bundle))
    model, _ = resolve_model(recorded, None, ignore_hash=False)  # an embedded model needs no --model
    assert model == "tiny-kimi"
    replayed = replay_run(recorded, model=model)
    report = compare(recorded, replayed)
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"] and report["statuses_identical"]
    assert {"tick": served.change["tick"], "changes": {"mla_chunked_prefill": True}} in replayed.lever_log
