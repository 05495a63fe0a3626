"""The MLA family in the tick loop: the reference's whole-prompt rule live, chunked MLA prefill beyond it.

tiny-kimi through the real scheduler: with ``mla_chunked_prefill`` off a prompt's chunk is its whole
remainder (cap ``mla_whole_prompt``, the slice budget ignored and said so), admission waits for the
whole prompt's blocks and rejects a prompt over the tick's token budget instead of stalling; with it
on, MLA prompts chunk and mix like any other and give the same tokens. Preemption, failure
isolation, SSM tail checkpoints (captured inside the whole chunk) and a live flip apply too.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine.cache.prefix_pool import EVENT_TAKEN
from engine.model.fault import ForwardFault
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from engine.scheduler.stall import blocker, head_needs
from engine.workload.multiturn import MultiTurnWorkload
from telemetry import events as ev
from telemetry.levers import defaults

LONG = dict(max_prefill_tokens=48, always_mixed=True, slice_budget=16)


@pytest.fixture(scope="module")
def kimi():
    torch.set_grad_enabled(False)
    return load_model("tiny-kimi")[0]


def requests(num: int, seed: int, *, lengths=(20, 200), max_tokens: int = 12):
    rng = random.Random(seed)
    return [(i, [rng.randrange(0, 256) for _ in range(rng.randrange(*lengths))],
             {"max_tokens": max_tokens, "min_tokens": max_tokens} if i % 2 else
             {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.8, "seed": 50 + i})
            for i in range(num)]


def run(model, reqs, levers=None, *, kv_blocks=256, ssm_slots=8, stagger=2, flips=None, fault=None,
        prefix_cache=False):
    """Serve ``reqs`` (one submitted every ``stagger`` ticks) to the end; ``flips``: {tick: lever changes}."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots, fault=fault)
    sched = Scheduler(runner, levers or defaults(), emit=rows.append, prefix_cache=prefix_cache)
    pending = list(reqs)
    while pending or sched.has_work:
        if flips and sched.tick in flips:
            sched.apply_levers(sched.levers.replace(**flips.pop(sched.tick)), source="file")
        if pending and sched.tick % stagger == 0:
            sched.submit(*pending.pop(0))
        if not sched.step() and pending:
            sched.submit(*pending.pop(0))
    runner.pools.blocks.check_invariants()
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0
    return sched, rows


def outputs(sched):
    return {r.request_id: r.output_tokens for r in sched.done}


def chunks(rows):
    return [r for r in rows if isinstance(r, ev.ChunkDecision)]


def test_whole_prompt_rule_is_live_and_lever_on_chunks_to_the_same_tokens(kimi):
    reqs = requests(8, seed=1)
    whole, whole_rows = run(kimi, reqs, defaults().replace(**LONG))
    chunked, chunked_rows = run(kimi, reqs, defaults().replace(**LONG, mla_chunked_prefill=True))
    assert outputs(chunked) == outputs(whole) and all(len(t) == 12 for t in outputs(whole).values())
    rows = chunks(whole_rows)
    assert all(c.offset == 0 and c.is_last and c.length == c.prompt_len for c in rows)  # never split
    capped = [c for c in rows if c.cap_rule == ev.CAP_WHOLE_PROMPT]
    assert capped and all(c.slice_budget_ignored and c.length > 16 for c in capped)
    assert any(c.path == ev.PATH_MIXED for c in rows)  # a whole prompt still fuses with the decodes
    rows = chunks(chunked_rows)
    assert all(c.length <= 16 and not c.slice_budget_ignored for c in rows)
    assert not any(c.cap_rule == ev.CAP_WHOLE_PROMPT for c in rows)
    assert any(c.offset > 0 and c.path == ev.PATH_MIXED for c in rows)  # chunks over cached latents, mixed


def test_lever_flips_live_between_ticks(kimi):
    reqs = requests(8, seed=2)
    flipped, rows = run(kimi, reqs, defaults().replace(**LONG), flips={6: {"mla_chunked_prefill": True},
                                                                        14: {"mla_chunked_prefill": False}})
    base, _ = run(kimi, reqs, defaults().replace(**LONG))
    assert outputs(flipped) == outputs(base)
    changes = [r for r in rows if isinstance(r, ev.LeverChange) and r.name == "mla_chunked_prefill"]
    assert [(c.tick, c.new) for c in changes] == [(6, True), (14, False)]
    by_tick = {c.tick: c for c in chunks(rows)}
    assert any(c.offset > 0 for t, c in by_tick.items() if 6 <= t < 14)
    assert all(c.length == c.prompt_len - c.offset for t, c in by_tick.items() if t < 6 and c.offset == 0)


def test_admission_waits_for_the_whole_prompt_and_names_it(kimi):
    runner = ModelRunner.build(kimi, num_kv_blocks=24, num_ssm_slots=4)
    sched = Scheduler(runner, defaults().replace(max_prefill_tokens=64))
    sched.submit(0, list(range(200)), {"max_tokens": 150, "min_tokens": 150})  # 22 blocks at its end
    for _ in range(40):
        sched.step()
    assert runner.pools.blocks.num_free == 9
    sched.submit(1, list(range(160)), {"max_tokens": 4})   # 10 blocks for the whole prompt: it waits
    sched.step()
    assert sched.prefilling is None and [r.request_id for r in sched.waiting] == [1]
    needs = head_needs(sched.waiting, runner.pools, sched.levers.max_prefill_tokens, whole_prompt=True)
    assert "whole 160-token prompt" in blocker(needs) and "mla_chunked_prefill off" in blocker(needs)
    # Under chunked MLA prefill its first 64-token chunk (4 blocks) would start now.
    assert blocker(head_needs(sched.waiting, runner.pools, sched.levers.max_prefill_tokens)) is None
    while sched.has_work:
        sched.step()
    assert [r.status for r in sched.done] == [ev.REQ_FINISHED, ev.REQ_FINISHED]
    first_chunk = next(r for r in sched.done if r.request_id == 1).admitted_tick
    assert first_chunk > next(r for r in sched.done if r.request_id == 0).admitted_tick + 40


def test_a_prompt_over_the_tick_budget_is_rejected_and_the_queue_moves_on(kimi):
    levers = defaults().replace(max_tick_tokens=120)
    sched, rows = run(kimi, [(0, list(range(150)), {"max_tokens": 3}), (1, list(range(60)), {"max_tokens": 3})],
                      levers)
    by_id = {r.request_id: r for r in sched.done}
    assert by_id[0].status == ev.REQ_REJECTED and "max_tick_tokens = 120" in by_id[0].error
    assert by_id[1].status == ev.REQ_FINISHED
    # With chunked MLA prefill the budget does not bind: chunks are max_prefill_tokens at most.
    sched, _ = run(kimi, [(0, list(range(150)), {"max_tokens": 3})], levers.replace(mla_chunked_prefill=True))
    assert sched.done[0].status == ev.REQ_FINISHED


def test_a_waiting_prompt_is_rejected_when_a_flip_makes_it_unrunnable(kimi):
    runner = ModelRunner.build(kimi, num_kv_blocks=64, num_ssm_slots=4)
    sched = Scheduler(runner, defaults().replace(mla_chunked_prefill=True, max_tick_tokens=100))
    sched.submit(0, list(range(30)), {"max_tokens": 20, "min_tokens": 20})
    sched.step()
    sched.submit(1, list(range(150)), {"max_tokens": 2})   # fine while chunking: accepted
    sched.apply_levers(sched.levers.replace(mla_chunked_prefill=False), source="file")
    while sched.has_work:
        sched.step()
    ended = {r.request_id: r for r in sched.done}
    assert ended[1].status == ev.REQ_REJECTED and "can never start" in ended[1].error
    assert ended[0].status == ev.REQ_FINISHED


def test_preemption_under_both_rules_ends_requests_exactly(kimi):
    reqs = requests(10, seed=4, lengths=(60, 180), max_tokens=40)
    for lever in (False, True):
        sched, rows = run(kimi, reqs, defaults().replace(mla_chunked_prefill=lever), kv_blocks=40, stagger=1)
        preempted = [r for r in sched.done if r.status == ev.REQ_PREEMPTED]
        assert preempted and any(isinstance(r, ev.Preemption) for r in rows)
        alone, _ = run(kimi, [q for q in reqs if q[0] not in {p.request_id for p in preempted}])
        survivors = {i: t for i, t in outputs(sched).items() if i not in {p.request_id for p in preempted}}
        assert survivors == outputs(alone)  # preemption moved no other request's token


def test_a_failed_whole_prompt_forward_ends_only_its_request(kimi):
    reqs = requests(6, seed=5)
    fault = ForwardFault.parse("3:prefill+mixed")
    faulty, _ = run(kimi, reqs, fault=fault)
    clean, _ = run(kimi, reqs)
    ended = {r.request_id: r for r in faulty.done}
    assert ended[3].status == ev.REQ_ERROR
    assert {i: t for i, t in outputs(faulty).items() if i != 3} == {i: t for i, t in outputs(clean).items() if i != 3}


def test_ssm_tail_checkpoint_is_captured_inside_the_whole_prompt(kimi):
    """Multi-turn prompts share prefixes: the KDA state at the tail boundary is captured inside the
    whole-prompt chunk (it cannot be cut there) and restored by the next turn; tokens as without cache."""
    convo = MultiTurnWorkload(vocab_size=256, num_conversations=2, num_turns=3, user_len_median=40, output_len=6,
                              seed=3).requests()
    reqs = [(r.request_id, r.prompt_tokens, {"max_tokens": 6, "min_tokens": 6}) for r in convo]
    levers = defaults().replace(ssm_tail_ckpt=True)
    cached, rows = run(kimi, reqs, levers, prefix_cache=True, stagger=1)
    plain, _ = run(kimi, reqs, levers, stagger=1)
    assert outputs(cached) == outputs(plain)
    taken = [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == EVENT_TAKEN]
    assert any(r.detail["how"] == "midchunk" for r in taken)
    assert any(r.prefix_hit_tokens > 0 for r in cached.done)
    assert not any(c.cap_rule == ev.CAP_SSM_TAIL for c in chunks(rows))  # never cut
