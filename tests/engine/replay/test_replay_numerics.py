"""A replay computes in the run's recorded dtype (refusing, in one line, one this machine cannot run)
and names the cause of a divergence: a decision that differs, or a token that differs with the
logits' top-2 margin at that position."""
from __future__ import annotations

import copy
import json
import sqlite3
from types import SimpleNamespace

import pytest
import torch

from engine.__main__ import main
from engine.replay import divergence
from engine.replay.compare import compare
from engine.replay.record import ReplayInputError
from engine.replay.rerun import load_input, replay_run
from engine.replay.run_dtype import replay_dtype
from telemetry.bundle_export import export_bundle
from tests.engine.ep_process import engine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A finished serve run of the tiny model (half the requests greedy, half seeded), as a bundle."""
    run_dir = tmp_path_factory.mktemp("served")
    done = engine("serve", "--model", "tiny", "--run-dir", str(run_dir), "--requests", "10", "--rate", "1000",
                  "--seed", "3", "--threads", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    bundle = export_bundle(run_dir / "telemetry.db", run_dir / "bundle.zip").path
    recorded, manifest = load_input(str(bundle))
    return SimpleNamespace(run_dir=run_dir, bundle=bundle, recorded=recorded, manifest=manifest,
                           replayed=replay_run(recorded, model="tiny"))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["replay", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_dtype_is_recorded_once_and_the_replay_says_which_it_used(served, capsys):
    dtype = served.recorded.config["dtype"]
    assert dtype in ("float32", "bfloat16") and served.recorded.config["dtype_choice"] == "auto"
    assert served.manifest["numerics"]["dtype"] == dtype and served.manifest["numerics"]["cpu_model"]
    assert served.replayed.dtype == dtype
    assert next(served.replayed.model.parameters()).dtype == getattr(torch, dtype)
    status, out, err = run_cli(capsys, str(served.bundle))
    assert status == 0, err
    assert f"numerics:  replayed in {dtype} on " in out and f"recorded in {dtype} on " in out
    assert "cause:     none (nothing diverged)" in out
    status, out, err = run_cli(capsys, str(served.bundle), "--json")
    report = json.loads(out)
    assert report["numerics"]["recorded"]["dtype"] == report["numerics"]["replayed"]["dtype"] == dtype
    assert report["divergence_cause"] is None and report["tokens_identical"]


def test_a_dtype_the_machine_cannot_run_is_refused_in_one_line(served, tmp_path, capsys):
    db = tmp_path / "telemetry.db"
    source, target = sqlite3.connect(served.run_dir / "telemetry.db"), sqlite3.connect(db)
    source.backup(target)
    source.close()
    with target:
        target.execute("UPDATE runs SET config = json_set(config, '$.dtype', 'float16')")
    target.close()
    status, out, err = run_cli(capsys, str(db))
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "float16" in err and "cannot replay" in err
    with pytest.raises(ReplayInputError, match="CUDA device cuda cannot run"):
        replay_dtype({"dtype": "bfloat16"}, "cuda", cuda_bf16=False)
    assert replay_dtype({}, "cpu") == "float32"   # a run from before the dtype was recorded computed in fp32


def test_a_decision_that_differs_is_named_a_decision(served):
    tampered = copy.deepcopy(served.recorded)
    tampered.chunks[len(tampered.chunks) // 2].length += 1
    report = compare(tampered, served.replayed)
    cause = divergence.explain(report, tampered, served.replayed.model, served.replayed.dtype)
    assert cause["kind"] == "decision" and cause["verdict"] == "bug" and "chunk.length" in cause["why"]


def _greedy_position(recorded, pick):
    """(request, index, logits [V]) of a greedy request's output position chosen by ``pick``."""
    candidates = []
    for request in recorded.requests:
        outputs = recorded.output_tokens()[request.request_id]
        if request.sampling.get("temperature") != 0 or len(outputs) < 3:
            continue
        logits = divergence.sequence_logits(served_model(recorded), list(request.prompt_tokens) + outputs)
        first = len(request.prompt_tokens) - 1   # row predicting output token 0
        for index in range(1, len(outputs)):
            candidates.append((request, index, logits[first + index]))
    return pick(candidates)


_MODELS = {}


def served_model(recorded):
    from engine.model.loader import load_model
    dtype = recorded.config["dtype"]
    if dtype not in _MODELS:
        _MODELS[dtype] = load_model("tiny", dtype=getattr(torch, dtype))[0]
    return _MODELS[dtype]


def _tamper_token(recorded, request, index: int, token: int):
    tampered = copy.deepcopy(recorded)
    row = next(t for t in tampered.tokens if t.request_id == request.request_id and t.index == index)
    row.token_id = token
    for r in tampered.requests:
        if r.request_id == request.request_id and r.output_tokens:
            r.output_tokens[index] = token
    return tampered


def test_a_token_the_model_clearly_did_not_prefer_is_named_a_bug(served, capsys):
    """The recording says a greedy request picked the token the model ranks last: a wide margin
    (at the position where the model was surest, so the served run's batch shape cannot matter)."""
    request, index, logits = _greedy_position(
        served.recorded, lambda c: max(c, key=lambda item: float(torch.topk(item[2], 2).values.diff().abs())))
    replayed_token = served.recorded.output_tokens()[request.request_id][index]
    assert int(logits.argmax()) == replayed_token   # the standalone forward agrees with the served run
    worst = int(logits.argmin())
    tampered = _tamper_token(served.recorded, request, index, worst)
    report = compare(tampered, served.replayed)
    assert report["decisions_identical"] and report["first_divergence"]["field"] == f"output_tokens[{index}]"
    cause = divergence.explain(report, tampered, served.replayed.model, served.replayed.dtype)
    assert cause["kind"] == "token" and cause["verdict"] == "bug", cause
    top2 = torch.topk(logits, 2).values
    assert cause["top2_margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4)
    assert cause["logits"]["recorded"]["rank"] == logits.shape[0] and cause["logits"]["replayed"]["rank"] == 1
    assert cause["logit_gap"] == pytest.approx(float(logits.max() - logits.min()), abs=1e-4)
    assert "clearly preferred" in divergence.cause_line(cause)


def test_a_token_at_the_closest_call_is_judged_by_its_margin(served):
    """The recording says a greedy request picked the runner-up where the model came closest to a
    tie: the cause is a token, the margin is that position's, and the verdict follows the tolerance."""
    request, index, logits = _greedy_position(
        served.recorded, lambda c: min(c, key=lambda item: float(torch.topk(item[2], 2).values.diff().abs())))
    top = torch.topk(logits, 2)
    served_token = served.recorded.output_tokens()[request.request_id][index]
    # At a near tie the served run's batch shape may have picked the standalone forward's runner-up.
    other = int(top.indices[0]) if served_token == int(top.indices[1]) else int(top.indices[1])
    tampered = _tamper_token(served.recorded, request, index, other)
    report = compare(tampered, served.replayed)
    cause = divergence.explain(report, tampered, served.replayed.model, served.replayed.dtype)
    margin = float(top.values[0] - top.values[1])
    assert cause["kind"] == "token" and cause["top2_margin"] == pytest.approx(margin, abs=1e-4)
    assert {cause["logits"]["recorded"]["rank"], cause["logits"]["replayed"]["rank"]} == {1, 2}
    assert cause["verdict"] == ("numerics" if cause["logit_gap"] <= cause["tolerance"] else "bug")
    print(f"closest call: top-2 margin {margin:.3g}, tolerance {cause['tolerance']:.3g} -> {cause['verdict']}")


@pytest.mark.parametrize("dtype, gap, verdict", [("float32", 5e-5, "numerics"), ("float32", 0.02, "bug"),
                                                 ("bfloat16", 0.02, "numerics"), ("bfloat16", 0.5, "bug")])
def test_the_near_tie_tolerance_follows_the_dtype(dtype, gap, verdict):
    logits = torch.full((8,), -3.0)
    logits[2], logits[5] = 1.0, 1.0 - gap
    first = {"tick": 4, "request_id": 0, "field": "output_tokens[3]", "recorded": 5, "replayed": 2}
    cause = divergence.classify(first, divergence.token_margin(logits, 5, 2), dtype)
    assert cause["verdict"] == verdict and cause["top2_margin"] == pytest.approx(gap, rel=1e-3)
    flipped = divergence.classify({**first, "field": "tick.path"}, None, dtype, flipped=True)
    assert flipped["kind"] == "decision" and flipped["verdict"] == "flip"


def test_a_flipped_replay_names_the_flip_as_the_cause(served, capsys):
    """Through the CLI: a KV cap the recording never had changes the scheduling first."""
    status, out, err = run_cli(capsys, str(served.bundle), "--json", "--flip", "kv_blocks_cap=6")
    assert status == 0, err
    report = json.loads(out)
    assert not report["decisions_identical"]
    assert report["divergence_cause"]["kind"] == "decision" and report["divergence_cause"]["verdict"] == "flip"
    status, out, _ = run_cli(capsys, str(served.bundle), "--flip", "kv_blocks_cap=6")
    assert status == 0 and "cause:     decision differs, flip: the first difference is a scheduling decision" in out
