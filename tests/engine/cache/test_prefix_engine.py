"""The prefix cache in the live engine: identical tokens, explained misses, exact reference counts."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model.loader import load_model
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.scheduler import prefix_step
from engine.scheduler.loop import Scheduler
from engine.cache.sequence import SequenceState
from engine.workload.multiturn import MultiTurnWorkload
from telemetry import events as ev
from telemetry.levers import defaults

BS = 16
CKPT = {"ssm_tail_ckpt": True}
MIDCHUNK = {"ssm_tail_ckpt": True, "ssm_tail_midchunk": True}


@pytest.fixture(scope="module")
def tiny():
    torch.set_grad_enabled(False)
    model, _, _ = load_model("tiny")
    return model


def conversations(seed: int = 1, num_conversations: int = 3, num_turns: int = 3):
    return MultiTurnWorkload(vocab_size=256, num_conversations=num_conversations, num_turns=num_turns,
                             user_len_median=40, output_len=8, seed=seed).requests()


class Run:
    def __init__(self, sched: Scheduler, rows: list):
        self.sched, self.rows = sched, rows
        self.requests = {r.request_id: r for r in sched.done}
        self.outputs = {i: r.output_tokens for i, r in self.requests.items()}
        self.hits = {i: r.prefix_hit_tokens for i, r in self.requests.items()}

    def events(self, kind: str) -> list[ev.GenericEvent]:
        return [r for r in self.rows if isinstance(r, ev.GenericEvent) and r.kind == kind]

    @property
    def chunks(self) -> list[ev.ChunkDecision]:
        return [r for r in self.rows if isinstance(r, ev.ChunkDecision)]


def check_all(sched: Scheduler) -> None:
    runner = sched.runner
    runner.pools.ssm.check_invariants()
    if sched.prefix is not None:
        sched.prefix.cache.check_invariants()  # block manager included
    else:
        runner.pools.blocks.check_invariants()
    live = [r for r in [sched.prefilling, *sched.active] if r is not None]
    for request in live:  # a block a live request holds is never free nor evictable
        for block_id in request.seq.block_table:
            assert runner.pools.blocks.ref_count(block_id) >= 1


def run(model, specs, *, prefix: bool, levers: dict | None = None, kv_blocks: int = 256,
        ssm_slots: int = 8, stagger: int = 3, max_snapshots: int | None = None) -> Run:
    """Submit one request every ``stagger`` ticks (so prefill mixes with decodes); run to the end."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots)
    sched = Scheduler(runner, defaults().replace(**(levers or {})), emit=rows.append, prefix_cache=prefix)
    if max_snapshots is not None:
        sched.prefix.max_snapshots = max_snapshots
    pending = list(specs)
    while pending or sched.has_work:
        if pending and sched.tick % stagger == 0 or pending and not sched.has_work:
            spec = pending.pop(0)
            sched.submit(spec.request_id, spec.prompt_tokens, spec.sampling, conversation_id=spec.conversation_id)
        sched.step()
        check_all(sched)
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0, "leaked blocks or slots"
    return Run(sched, rows)


@pytest.fixture(scope="module")
def runs(tiny):
    specs = conversations()
    return specs, {name: run(tiny, specs, prefix=prefix, levers=levers) for name, prefix, levers in [
        ("no_cache", False, CKPT), ("off", True, {}), ("ckpt", True, CKPT), ("midchunk", True, MIDCHUNK)]}


def later_turns(specs):
    return [s for s in specs if s.turn]


def test_prefix_hits_change_no_token(runs):
    specs, by_name = runs
    reference = by_name["no_cache"].outputs
    assert len(reference) == len(specs) and all(len(t) == 8 for t in reference.values())
    for name in ("off", "ckpt", "midchunk"):
        assert by_name[name].outputs == reference, name
    assert sum(by_name["ckpt"].hits.values()) > 0, "the identity must be checked with real hits"
    assert any(c.path == ev.PATH_MIXED for c in by_name["ckpt"].chunks), "hits must also run fused"


def test_tail_checkpoints_give_hits_on_later_turns(runs):
    specs, by_name = runs
    ckpt, off = by_name["ckpt"], by_name["off"]
    for spec in later_turns(specs):
        previous = next(s for s in specs if s.conversation_id == spec.conversation_id and s.turn == spec.turn - 1)
        # The previous prompt's tail boundary (its last full block inside it) is restorable.
        assert ckpt.hits[spec.request_id] == (previous.prompt_len - 1) // BS * BS, spec.request_id
        request = ckpt.requests[spec.request_id]
        assert request.chunk_offset == request.prompt_len  # prefill started at the hit, ran to the end
    # Without the lever a snapshot exists only where a prompt ends block-aligned: (nearly) no hits.
    aligned = {s.request_id for s in specs if s.prompt_len % BS == 0}
    assert sum(off.hits.values()) <= BS * len(specs) * len(aligned)
    assert sum(ckpt.hits.values()) > 3 * sum(off.hits.values())
    taken = ckpt.events(prefix_step.EVENT_TAKEN)
    assert {e.detail["how"] for e in taken} == {prefix_step.HOW_CHUNK_END}
    assert all(e.detail["position"] % BS == 0 and e.request_id is not None for e in taken)
    restored = ckpt.events(prefix_step.EVENT_RESTORED)
    assert {(e.request_id, e.detail["position"]) for e in restored} == {
        (i, h) for i, h in ckpt.hits.items() if h}
    assert len(ckpt.events(prefix_step.EVENT_HIT)) == len(restored)


def test_missed_hit_is_explained_in_the_request_row(runs):
    specs, by_name = runs
    off = by_name["off"]
    explained = 0
    for spec in later_turns(specs):
        request = off.requests[spec.request_id]
        if request.prefix_hit_tokens == 0:
            assert request.prefix_miss_reason.startswith("no SSM snapshot at token"), request.prefix_miss_reason
            explained += 1
            rows = [r for r in off.rows if isinstance(r, ev.RequestRecord) and r.request_id == spec.request_id]
            assert rows[-1].prefix_miss_reason == request.prefix_miss_reason
            assert rows[-1].prefix_hit_tokens == 0
    assert explained >= len(later_turns(specs)) - 1
    cuts = off.events(prefix_step.EVENT_SSM_CUT)
    assert cuts and all(e.detail["num_kv_tokens"] > e.detail["num_tokens"] for e in cuts)
    first = off.requests[0]
    assert first.prefix_miss_reason == f"no cached KV block at token 0 (matchable {(first.prompt_len - 1) // BS * BS})"


def test_midchunk_capture_gives_the_hits_without_cutting_chunks(runs):
    _, by_name = runs
    cut, mid = by_name["ckpt"], by_name["midchunk"]
    assert mid.hits == cut.hits and mid.outputs == cut.outputs
    assert any(c.cap_rule == ev.CAP_SSM_TAIL for c in cut.chunks)
    assert not any(c.cap_rule == ev.CAP_SSM_TAIL for c in mid.chunks)
    assert len(mid.chunks) < len(cut.chunks)
    assert prefix_step.HOW_MIDCHUNK in {e.detail["how"] for e in mid.events(prefix_step.EVENT_TAKEN)}


def test_midchunk_capture_matches_the_state_of_a_cut(tiny):
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(150)]
    runner = ModelRunner.build(tiny, num_kv_blocks=64, num_ssm_slots=4)
    cut = _fresh(runner, 1)
    assert runner.forward(ForwardBatch.chunk(cut, prompt, 0, 70, False)).capture is None
    expected = runner.pools.ssm.snapshot(cut.ssm_slot)  # the state a chunk cut at 70 leaves
    reference = runner.prefill_chunk(_fresh(runner, 2), prompt, 0, 150, True)
    out = runner.forward(ForwardBatch.chunk(_fresh(runner, 3), prompt, 0, 150, True, capture_at=70))
    logits, got = out.prefill_logits, out.capture
    torch.testing.assert_close(got.conv, expected.conv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.recurrent, expected.recurrent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert int(logits.argmax()) == int(reference.argmax())
    with pytest.raises(ValueError, match="capture_at=150 must lie strictly inside"):
        runner.forward(ForwardBatch.chunk(_fresh(runner, 4), prompt, 0, 150, True, capture_at=150))


def _fresh(runner: ModelRunner, request_id: int) -> SequenceState:
    seq = SequenceState(request_id)
    runner.pools.admit(seq)
    return seq


def test_eviction_under_pressure_never_frees_a_block_in_use(tiny):
    specs = conversations(seed=4, num_conversations=4, num_turns=3)
    reference = run(tiny, specs, prefix=False)
    tight = run(tiny, specs, prefix=True, levers=CKPT, kv_blocks=24, ssm_slots=4, stagger=2)
    assert tight.sched.pools.blocks.num_evictions > 0, "the cache must be under pressure"
    evicted = tight.events(prefix_step.EVENT_EVICTED)
    assert evicted and all(e.detail["block_hash"] and e.request_id is not None for e in evicted)
    finished = [i for i, r in tight.requests.items() if r.status == ev.REQ_FINISHED]
    assert finished
    for request_id in finished:
        assert tight.outputs[request_id] == reference.outputs[request_id], request_id
    assert tight.sched.prefix.num_snapshots == sum(
        1 for h in tight.sched.prefix._snapshot_origin if tight.sched.prefix.cache.snapshot_at(h) is not None)


SHARED = [[random.Random(i).randrange(256) for _ in range(48)] for i in range(3)]


@st.composite
def request_streams(draw):
    num = draw(st.integers(3, 7))
    stream = []
    for request_id in range(num):
        prefix = SHARED[draw(st.integers(0, 2))][:draw(st.integers(0, 48))]
        suffix = draw(st.lists(st.integers(0, 255), min_size=1, max_size=40))
        stream.append((request_id, prefix + suffix, {"max_tokens": draw(st.integers(1, 4))},
                       draw(st.integers(0, 3))))  # ticks to wait before submitting
    levers = draw(st.sampled_from([{}, CKPT, MIDCHUNK]))
    max_prefill = draw(st.sampled_from([16, 24, 256]))
    return stream, {**levers, "max_prefill_tokens": max_prefill}, draw(st.integers(10, 24))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(case=request_streams())
def test_random_request_streams_keep_reference_counts_exact(tiny, case):
    stream, levers, kv_blocks = case
    runner = ModelRunner.build(tiny, num_kv_blocks=kv_blocks, num_ssm_slots=3)
    sched = Scheduler(runner, defaults().replace(**levers), prefix_cache=True)
    pending, wait = list(stream), 0
    while pending or sched.has_work:
        if pending and wait <= 0:
            request_id, prompt, sampling, wait = pending.pop(0)
            sched.submit(request_id, prompt, sampling)
        wait -= 1
        sched.step()
        check_all(sched)
    bm = runner.pools.blocks
    assert bm.num_used == 0 and runner.pools.ssm.num_used == 0
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.num_evictable == sched.prefix.cache.num_cached_blocks
    stats = sched.prefix.cache.stats
    admitted = [r for r in sched.done if r.admitted_ns is not None]
    assert stats.num_lookups == len(admitted)
    assert stats.num_hit_tokens == sum(r.prefix_hit_tokens for r in admitted)
    assert all(r.prefix_hit_tokens % BS == 0 and r.prefix_hit_tokens < r.prompt_len for r in admitted)
    assert Counter(r.status for r in sched.done)[ev.REQ_REJECTED] == 0


def test_serve_flag_turns_the_prefix_cache_on_by_default():
    import argparse

    from engine.cli import serve
    from engine.serve.engine_setup import build_engine

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--run-dir", "x"]).prefix_cache is True
    assert parser.parse_args(["serve", "--run-dir", "x", "--no-prefix-cache"]).prefix_cache is False
    on = build_engine("tiny", kv_blocks=8, ssm_slots=1, levers=defaults(), device="cpu")
    off = build_engine("tiny", kv_blocks=8, ssm_slots=1, levers=defaults(), device="cpu", prefix_cache=False)
    assert on.scheduler.prefix is not None and on.engine_config["prefix_cache"] is True
    assert off.scheduler.prefix is None and off.engine_config["prefix_cache"] is False


def test_snapshot_cap_drops_the_least_recently_used(tiny, runs):
    specs, by_name = runs
    capped = run(tiny, specs, prefix=True, levers=CKPT, max_snapshots=1)
    dropped = [e for e in capped.events(prefix_step.EVENT_EVICTED) if e.detail["cause"] == "snapshot_cap"]
    assert len(dropped) == len(capped.events(prefix_step.EVENT_TAKEN)) - 1
    assert capped.sched.prefix.num_snapshots == 1
    assert capped.outputs == by_name["no_cache"].outputs
    assert 0 < sum(capped.hits.values()) < sum(by_name["ckpt"].hits.values())
