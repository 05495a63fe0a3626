"""Every speculation kind (ngram, mtp, self) at k = 1, 2, 4 emits exactly the tokens of speculation off.

Greedy and seeded sampled requests, alone and inside a serving run with fused (mixed) ticks
and preemptions. The drafts must really be verified and accepted, or the identity would be
trivial: each run also checks that drafts were accepted.
"""
from __future__ import annotations

import random

import pytest

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults

KINDS = ("ngram", "mtp", "self")
GREEDY = {"max_tokens": 40}
SAMPLED = {"max_tokens": 40, "temperature": 0.8, "top_p": 0.95, "seed": 5}


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    assert model.has_mtp_head and model.has_self_draft
    return model


def serve(model, arrivals, levers, *, kv_blocks=256, block_size=16):
    """``arrivals``: tick -> [(request_id, prompt, sampling)]; returns ({id: (status, tokens)}, rows)."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=4, block_size=block_size)
    sched = Scheduler(runner, levers, emit=rows.append)
    pending = dict(arrivals)
    while pending or sched.has_work:
        for request in pending.pop(sched.tick, []):
            sched.submit(*request)
        if not sched.step() and pending:
            sched.tick = min(pending)
    runner.pools.blocks.check_invariants()
    runner.pools.ssm.check_invariants()
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0, "leaked blocks or slots"
    return {r.request_id: (r.status, list(r.output_tokens)) for r in sched.done}, rows


def spec_details(rows):
    return [r.detail for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"]


def prompts():
    rng = random.Random(3)
    text = [[rng.randrange(32, 127) for _ in range(20)] for _ in range(2)]
    unit = [rng.randrange(256) for _ in range(5)]
    return text + [(unit * 8)[:37]]


@pytest.fixture(scope="module")
def off_outputs(tiny):
    return {(i, name): serve(tiny, {0: [(i, p, sampling)]}, defaults())[0][i][1]
            for i, p in enumerate(prompts()) for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED))}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_alone_greedy_and_seeded_sampled_match_off(tiny, off_outputs, kind, k):
    levers = defaults().replace(speculation=kind, num_speculative_tokens=k)
    details = []
    for i, prompt in enumerate(prompts()):
        for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
            outputs, rows = serve(tiny, {0: [(i, prompt, sampling)]}, levers)
            assert outputs[i] == (ev.REQ_FINISHED, off_outputs[(i, name)]), f"{kind} k={k} {name} prompt {i}"
            details += spec_details(rows)
    assert all(d["kind"] == kind and d["num_drafted"] <= k for d in details)
    assert sum(d["num_accepted"] for d in details) > 0, f"{kind}: no draft was ever accepted"
    assert any(d["num_accepted"] < d["num_drafted"] for d in details), f"{kind}: no partial acceptance"


def serving_arrivals():
    """Seven requests, greedy and seeded sampled; the first and the last decode alone for a while
    (speculative steps on a repeating prompt), the others overlap (fused ticks, preemptions)."""
    rng = random.Random(11)
    requests = []
    for i in range(7):
        prompt = [rng.randrange(32, 127) for _ in range(rng.randrange(20, 60))]
        if i in (0, 6):
            prompt = (prompt[:5] * 12)[:rng.randrange(30, 50)]
        sampling = dict(GREEDY if i % 2 else SAMPLED, max_tokens=rng.randrange(24, 48), seed=100 + i)
        if i % 2:
            sampling.pop("seed")
        requests.append((i, prompt, sampling))
    return {0: [requests[0]], 10: [requests[1]], 14: [requests[2]], 30: [requests[3], requests[4]],
            33: [requests[5]], 60: [requests[6]]}


@pytest.fixture(scope="module")
def serving_off(tiny):
    # Enough blocks that nothing is preempted: the reference outputs.
    outputs, rows = serve(tiny, serving_arrivals(), defaults().replace(max_prefill_tokens=16), kv_blocks=256)
    assert not [r for r in rows if isinstance(r, ev.Preemption)]
    assert all(status == ev.REQ_FINISHED for status, _ in outputs.values())
    return outputs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_serving_run_with_mixed_ticks_and_preemptions_matches_off(tiny, serving_off, kind, k):
    levers = defaults().replace(speculation=kind, num_speculative_tokens=k, max_prefill_tokens=16)
    outputs, rows = serve(tiny, serving_arrivals(), levers, kv_blocks=26, block_size=8)
    preempted = [rid for rid, (status, _) in outputs.items() if status == ev.REQ_PREEMPTED]
    assert preempted, "the small cache should have preempted someone"
    assert any(isinstance(r, ev.Tick) and r.path == ev.PATH_MIXED for r in rows), "no fused tick"
    for rid, (status, tokens) in outputs.items():
        reference = serving_off[rid][1]
        if status == ev.REQ_FINISHED:
            assert tokens == reference, f"{kind} k={k}: request {rid} differs from off"
        else:
            assert status == ev.REQ_PREEMPTED and tokens == reference[:len(tokens)], f"request {rid}"
    details = spec_details(rows)
    assert sum(d["num_accepted"] for d in details) > 0


def test_the_ngram_min_match_lever_through_the_engine(tiny, off_outputs):
    """``ngram_min_match`` 3 (what ./run.sh sets for byte-token tiny-chat) drafts only after a 3-token
    suffix recurs: fewer drafts than the lever's default 1 on text, the same tokens as off either way."""
    drafted = {}
    for min_match in (1, 3):
        levers = defaults().replace(speculation="ngram", ngram_min_match=min_match)
        details = []
        for i, prompt in enumerate(prompts()):
            outputs, rows = serve(tiny, {0: [(i, prompt, GREEDY)]}, levers)
            assert outputs[i] == (ev.REQ_FINISHED, off_outputs[(i, "greedy")]), f"min_match {min_match} prompt {i}"
            details += spec_details(rows)
        drafted[min_match] = sum(d["num_drafted"] for d in details)
    assert 0 < drafted[3] < drafted[1], drafted
