"""The tick loop on the tiny model: mixing and batching change no token, preemption is exact."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.endings import PREEMPT_FOR_PREFILL
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults


@pytest.fixture(scope="module")
def tiny():
    model, config, _ = load_model("tiny")
    return model


def make_requests(num: int, seed: int, *, max_len: int = 150, max_tokens: int = 24, greedy: bool = True):
    rng = random.Random(seed)
    out = []
    for i in range(num):
        sampling = {"max_tokens": max_tokens}
        if not greedy and i % 2:
            sampling.update(temperature=0.8, top_k=20, top_p=0.9, seed=1000 + i)
        out.append((i, [rng.randrange(0, 256) for _ in range(rng.randrange(3, max_len))], sampling))
    return out


def run(model, requests, levers=None, *, kv_blocks=1024, ssm_slots=16, stagger=0):
    """Run ``requests`` to completion; ``stagger`` submits one request every N ticks."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots)
    sched = Scheduler(runner, levers or defaults(), emit=rows.append)
    pending = list(requests)
    while pending or sched.has_work:
        if pending and (stagger == 0 or sched.tick % stagger == 0):
            for _ in range(1 if stagger else len(pending)):
                sched.submit(*pending.pop(0))
        if not sched.step() and pending:
            sched.submit(*pending.pop(0))
    runner.pools.blocks.check_invariants()
    runner.pools.ssm.check_invariants()
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0, "leaked blocks or slots"
    return sched, rows


def outputs(sched):
    return {r.request_id: r.output_tokens for r in sched.done}


def test_mixing_and_batching_change_no_token(tiny):
    requests = make_requests(10, seed=3, greedy=False)
    mixed, mixed_rows = run(tiny, requests, stagger=3)
    no_mix, no_mix_rows = run(tiny, requests, defaults().replace(bisect_no_mix=True), stagger=3)
    paths = Counter(r.path for r in mixed_rows if isinstance(r, ev.ChunkDecision))
    assert paths[ev.PATH_MIXED] > 0, "the staggered workload must exercise the fused path"
    assert not any(r.path == ev.PATH_MIXED for r in no_mix_rows if isinstance(r, ev.ChunkDecision))
    assert outputs(mixed) == outputs(no_mix)
    for request_id, prompt, sampling in requests:
        alone, _ = run(tiny, [(request_id, prompt, sampling)])
        assert outputs(alone)[request_id] == outputs(mixed)[request_id], f"request {request_id}"


def test_every_tick_and_chunk_is_logged(tiny):
    sched, rows = run(tiny, make_requests(6, seed=5), stagger=2)
    ticks = [r for r in rows if isinstance(r, ev.Tick)]
    assert [t.tick for t in ticks] == list(range(sched.tick))
    assert all(t.path in (ev.PATH_MIXED, ev.PATH_PREFILL, ev.PATH_DECODE) for t in ticks)
    chunks = [r for r in rows if isinstance(r, ev.ChunkDecision)]
    by_request: dict[int, list] = {}
    for c in chunks:
        by_request.setdefault(c.request_id, []).append(c)
        assert c.cap_rule and c.length >= 1 and c.outcome == "ok"
        assert c.can_mix == (c.mix_blocker is None)
    for request_id, request_chunks in by_request.items():
        assert sum(c.length for c in request_chunks) == request_chunks[0].prompt_len
        assert request_chunks[-1].is_last
    for tick in ticks:
        assert tick.kv_blocks_total == 1024 and tick.ssm_slots_total == 16
    finished = [r for r in rows if isinstance(r, ev.RequestRecord) and r.status == ev.REQ_FINISHED]
    assert len(finished) == 6


def test_small_kv_budget_preempts_the_reference_victim(tiny):
    # Long prompts prefilled in small chunks while earlier requests decode: the plain
    # path (no mixing) must take blocks from the active sequence holding the most.
    levers = defaults().replace(bisect_no_mix=True, max_prefill_tokens=32)
    requests = [(0, list(range(1, 120)), {"max_tokens": 40}), (1, list(range(5, 40)), {"max_tokens": 40}),
                (2, list(range(7, 200)), {"max_tokens": 8})]
    sched, rows = run(tiny, requests, levers, kv_blocks=18, stagger=4)
    preemptions = [r for r in rows if isinstance(r, ev.Preemption)]
    assert preemptions, "the budget is far below demand"
    first = preemptions[0]
    assert first.prefill_request_id is not None and first.reason == PREEMPT_FOR_PREFILL
    victim = next(r for r in sched.done if r.request_id == first.victim_request_id)
    assert victim.status == ev.REQ_PREEMPTED and victim.error == PREEMPT_FOR_PREFILL
    blocks_at_preemption = {0: 8 + 1, 1: 3 + 1}  # the longer-prompt request holds more blocks
    assert first.victim_request_id == max(blocks_at_preemption, key=blocks_at_preemption.get)
    assert all(r.finished_ns is not None for r in sched.done) and len(sched.done) == 3


def test_newest_policy_picks_latest_admitted(tiny):
    levers = defaults().replace(bisect_no_mix=True, max_prefill_tokens=32, preempt_policy="newest")
    requests = [(0, list(range(1, 120)), {"max_tokens": 40}), (1, list(range(5, 40)), {"max_tokens": 40}),
                (2, list(range(7, 200)), {"max_tokens": 8})]
    _, rows = run(tiny, requests, levers, kv_blocks=18, stagger=4)
    preemptions = [r for r in rows if isinstance(r, ev.Preemption)]
    assert preemptions and preemptions[0].victim_request_id == 1 and preemptions[0].policy == "newest"


def test_bad_requests_are_rejected_at_admission(tiny):
    runner = ModelRunner.build(tiny, num_kv_blocks=64, num_ssm_slots=4)
    rows: list = []
    sched = Scheduler(runner, defaults(), emit=rows.append)
    cases = {
        "empty": ([], {}, "prompt_tokens"),
        "oov": ([1, 2, 10_000], {}, "prompt_tokens[2]"),
        "negative": ([1, -3], {}, "prompt_tokens[1]"),
        "too_long_for_cache": (list(range(1, 200)) * 6, {}, "KV blocks"),
        "nan_temperature": ([1, 2], {"temperature": float("nan")}, "temperature"),
        "negative_temperature": ([1, 2], {"temperature": -1.0}, "temperature"),
        "top_p": ([1, 2], {"top_p": 1.5}, "top_p"),
        "top_p_zero": ([1, 2], {"top_p": 0.0}, "top_p"),
        "top_k": ([1, 2], {"top_k": -1}, "top_k"),
        "max_tokens": ([1, 2], {"max_tokens": 0}, "max_tokens"),
        "unknown_field": ([1, 2], {"temprature": 0.5}, "temprature"),
    }
    for i, (name, (prompt, sampling, field)) in enumerate(cases.items()):
        request = sched.submit(i, prompt, sampling)
        assert request.status == ev.REQ_REJECTED, name
        assert field in request.error, (name, request.error)
    assert not sched.has_work and sched.step() is False
    assert runner.pools.blocks.num_used == 0


def test_lever_change_applies_at_tick_boundary(tiny):
    runner = ModelRunner.build(tiny, num_kv_blocks=512, num_ssm_slots=8)
    rows: list = []
    sched = Scheduler(runner, defaults().replace(max_prefill_tokens=16), emit=rows.append)
    sched.submit(0, list(range(1, 30)), {"max_tokens": 60})
    for _ in range(4):
        sched.step()
    switch_tick = sched.tick
    sched.apply_levers(sched.levers.replace(bisect_no_mix=True), source="file", version=2)
    sched.submit(1, list(range(3, 120)), {"max_tokens": 4})
    while sched.has_work:
        sched.step()
    change = next(r for r in rows if isinstance(r, ev.LeverChange))
    assert (change.name, change.old, change.new, change.tick, change.file_version) == (
        "bisect_no_mix", False, True, switch_tick, 2)
    later = [r for r in rows if isinstance(r, ev.ChunkDecision) and r.tick >= switch_tick]
    assert later and all(r.path == ev.PATH_PREFILL and r.mix_blocker == ev.BLOCK_BISECT for r in later)


def test_prompt_longer_than_the_model_context_is_rejected(tiny, tmp_path):
    import dataclasses
    import json

    from engine.model.config import ModelConfig

    runner = ModelRunner.build(tiny, num_kv_blocks=64, num_ssm_slots=2)
    runner.config = dataclasses.replace(runner.config, max_position_embeddings=40)
    sched = Scheduler(runner, defaults())
    assert sched.submit(0, list(range(1, 45)), {}).error.startswith("prompt_tokens: 44 tokens do not fit")
    assert sched.submit(1, list(range(1, 30)), {}).status == ev.REQ_WAITING
    raw = {**tiny.config.to_hf_dict(), "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_hf_dict(raw).max_position_embeddings == 1024


def test_ssm_state_is_normalized_after_every_chunk_on_both_paths(tiny, monkeypatch):
    for levers in (defaults(), defaults().replace(bisect_no_mix=True)):
        runner = ModelRunner.build(tiny, num_kv_blocks=256, num_ssm_slots=4)
        calls: list[int] = []
        rows: list = []
        sched = Scheduler(runner, levers.replace(max_prefill_tokens=16), emit=rows.append)
        original = sched.pools.normalize
        monkeypatch.setattr(sched.pools, "normalize", lambda seq, *a: calls.append(seq.request_id) or original(seq))
        sched.submit(0, list(range(1, 20)), {"max_tokens": 30})
        for _ in range(3):
            sched.step()
        sched.submit(1, list(range(3, 60)), {"max_tokens": 4})
        while sched.has_work:
            sched.step()
        chunks = [r for r in rows if isinstance(r, ev.ChunkDecision)]
        assert len(calls) == len(chunks), (levers.bisect_no_mix, calls)
        expected_path = ev.PATH_PREFILL if levers.bisect_no_mix else ev.PATH_MIXED
        assert any(c.path == expected_path and c.request_id == 1 for c in chunks)


def test_a_mixed_kv_fallback_chunk_counts_its_prefill_tokens(tiny):
    # Mixing on and a small cache: the fused forward finds no blocks, the chunk runs plainly
    # (preempting) and the tick counts the tokens it computed.
    levers = defaults().replace(max_prefill_tokens=32)
    requests = [(0, list(range(1, 120)), {"max_tokens": 40}), (1, list(range(5, 40)), {"max_tokens": 40}),
                (2, list(range(7, 200)), {"max_tokens": 8})]
    _, rows = run(tiny, requests, levers, kv_blocks=18, stagger=4)
    ticks = {t.tick: t for t in rows if isinstance(t, ev.Tick)}
    fallbacks = [c for c in rows if isinstance(c, ev.ChunkDecision) and c.outcome == ev.OUTCOME_MIXED_KV_FALLBACK]
    assert fallbacks, "the budget must make the fused forward fall back"
    for chunk in fallbacks:
        assert chunk.path == ev.PATH_PREFILL and ticks[chunk.tick].num_prefill_tokens == chunk.length
    chunks = [c for c in rows if isinstance(c, ev.ChunkDecision)]
    assert {c.outcome for c in chunks} <= set(ev.CHUNK_OUTCOMES)
    assert sum(t.num_prefill_tokens for t in ticks.values()) == sum(
        c.length for c in chunks if c.outcome in ev.COMPUTED_OUTCOMES)


def test_midchunk_capture_keeps_the_tail_boundary_on_the_chunk_rows(tiny):
    from engine.scheduler.chunk_plan import ssm_tail_boundary

    runner = ModelRunner.build(tiny, num_kv_blocks=128, num_ssm_slots=4)
    rows: list = []
    levers = defaults().replace(ssm_tail_ckpt=True, ssm_tail_midchunk=True, max_prefill_tokens=64)
    sched = Scheduler(runner, levers, emit=rows.append, prefix_cache=True)
    sched.submit(0, list(range(1, 101)), {"max_tokens": 2})
    while sched.has_work:
        sched.step()
    chunks = [c for c in rows if isinstance(c, ev.ChunkDecision)]
    assert [c.ssm_tail_boundary for c in chunks] == [ssm_tail_boundary(100, 16)] * len(chunks) == [96, 96]
    assert all(c.cap_rule != ev.CAP_SSM_TAIL for c in chunks)  # captured inside the chunk, not cut
    taken = [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "snapshot_taken"]
    assert [r.detail["how"] for r in taken] == ["midchunk"]


def test_decode_rows_without_an_ssm_slot_sort_by_their_own_key():
    from types import SimpleNamespace

    from engine.scheduler.plan import decode_rows

    def request(request_id, slot):
        return SimpleNamespace(request_id=request_id, seq=SimpleNamespace(ssm_slot=slot))

    active = [request(9, 3), request(2, None), request(5, 0), request(7, 1)]
    # By SSM slot; the row without one by its request id (2), not ahead of everything at -1.
    assert [r.request_id for r in decode_rows(active)] == [5, 7, 2, 9]
