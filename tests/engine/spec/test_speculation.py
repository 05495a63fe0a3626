"""speculation=ngram on the tiny model: same tokens as off, real drafts, exact keep (no re-feed), honest telemetry.

Also: mtp is refused at lever time on a checkpoint without an MTP module.
(mtp and self against off: tests/engine/spec/test_spec_identity.py.)
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from engine.scheduler.sampling import SamplingParams, sample_next
from engine.scheduler import spec_step
from engine.spec import verify
from engine.spec.spec_support import speculation_rejection
from telemetry import events as ev
from telemetry.levers import defaults

NGRAM = defaults().replace(speculation="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    return model


def repetitive_prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    unit = [rng.randrange(256) for _ in range(rng.randrange(2, 9))]
    return (unit * length)[:length]


def run(model, arrivals, levers, *, kv_blocks=256, prefix_cache=False):
    """``arrivals``: tick -> [(request_id, prompt, sampling)]; runs everything to completion."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=4)
    sched = Scheduler(runner, levers, emit=rows.append, prefix_cache=prefix_cache)
    pending = dict(arrivals)
    while pending or sched.has_work:
        for request in pending.pop(sched.tick, []):
            sched.submit(*request)
        if not sched.step() and pending:
            sched.tick = min(pending)  # idle: jump to the next arrival
    runner.pools.blocks.check_invariants()
    runner.pools.ssm.check_invariants()
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0, "leaked blocks or slots"
    return {r.request_id: r.output_tokens for r in sched.done}, rows


def spec_rows(rows):
    return [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"]


def test_greedy_tokens_identical_to_off_and_drafts_really_accepted(tiny):
    prompts = [repetitive_prompt(s) for s in (0, 2, 5, 6)] + [[random.Random(9).randrange(256) for _ in range(30)]]
    spec = []
    for i, prompt in enumerate(prompts):
        arrivals = {0: [(i, prompt, {"max_tokens": 40})]}
        off, _ = run(tiny, arrivals, defaults())
        on, rows = run(tiny, arrivals, NGRAM)
        assert on == off, f"prompt {i}: speculation changed greedy tokens"
        spec += spec_rows(rows)
    details = [r.detail for r in spec]
    assert sum(d["num_accepted"] for d in details) >= 20, "n-gram drafts should be accepted on loops"
    assert any(d["num_accepted"] == d["num_drafted"] > 0 for d in details), "no fully accepted step"
    assert any(d["rolled_back"] for d in details), "no partial acceptance was rolled back"
    assert any(d["reused_pending"] for d in details), "pending drafts were never used"
    for d in details:
        assert 0 <= d["num_accepted"] <= d["num_drafted"] <= NGRAM.num_speculative_tokens
        assert d["num_emitted"] <= d["num_accepted"] + 1
        assert d["rolled_back"] == (d["num_accepted"] < d["num_drafted"] and d["num_emitted"] == d["num_accepted"] + 1)


def test_seeded_sampled_run_replays_exactly(tiny):
    # Low temperature: the sampled text still loops now and then, so drafts get verified.
    details = []
    for i, prompt_seed in enumerate((0, 3)):
        sampling = {"max_tokens": 40, "temperature": 0.3, "top_k": 5, "top_p": 0.95, "seed": 11}
        arrivals = {0: [(i, repetitive_prompt(prompt_seed), sampling)]}
        off, _ = run(tiny, arrivals, defaults())
        on, rows = run(tiny, arrivals, NGRAM)
        assert on == off
        details += [r.detail for r in spec_rows(rows)]
    assert sum(d["num_drafted"] for d in details) > 0 and sum(d["num_accepted"] for d in details) > 0


def test_prefix_cache_hits_keep_tokens_identical(tiny):
    prompt = repetitive_prompt(5, 70)
    arrivals = {0: [(0, prompt, {"max_tokens": 30})], 40: [(1, prompt + [3, 4], {"max_tokens": 30})]}
    with_ckpt = defaults().replace(ssm_tail_ckpt=True)
    off, _ = run(tiny, arrivals, with_ckpt, prefix_cache=True)
    on, rows = run(tiny, arrivals, with_ckpt.replace(speculation="ngram"), prefix_cache=True)
    assert on == off
    records = [r for r in rows if isinstance(r, ev.RequestRecord) and r.request_id == 1]
    assert records[-1].prefix_hit_tokens > 0  # the second request decoded on shared blocks
    assert sum(r.detail["num_accepted"] for r in spec_rows(rows)) > 0


def test_ticks_say_decode_and_count_the_verify_rows(tiny):
    _, rows = run(tiny, {0: [(0, repetitive_prompt(5), {"max_tokens": 30})]}, NGRAM)
    ticks = {r.tick: r for r in rows if isinstance(r, ev.Tick)}
    spec = [r for r in spec_rows(rows) if r.detail["num_drafted"]]
    assert spec
    for r in spec:
        assert ticks[r.tick].path == ev.PATH_DECODE
        assert ticks[r.tick].num_decode_tokens == r.detail["num_drafted"] + 1


@pytest.mark.parametrize("num_kept", [1, 2, 4])
def test_verify_then_keep_leaves_the_caches_of_plain_decodes(tiny, num_kept):
    prompt = repetitive_prompt(1, 37)
    tokens = [11, 22, 33, 44]  # fed token, then three drafts; keep the first num_kept rows

    def prefilled():
        runner = ModelRunner.build(tiny, num_kv_blocks=64, num_ssm_slots=2, block_size=4)
        seq = SimpleNamespace(request_id=0, block_table=[], ssm_slot=None, num_cached_tokens=0, mtp_hidden=None)
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, prompt, 0, len(prompt), True)
        return runner, seq

    plain, seq_a = prefilled()
    decode_logits = [plain.decode([seq_a], [t])[0] for t in tokens[:num_kept]]  # [V] each
    spec, seq_b = prefilled()
    start = seq_b.num_cached_tokens
    verified = verify.verify_forward(spec, seq_b, tokens)
    assert verified.logits.shape == (4, spec.vocab_size) and verified.start == start
    for row in range(num_kept):
        torch.testing.assert_close(verified.logits[row], decode_logits[row], rtol=1e-4, atol=1e-4)
    assert spec.pools.blocks.num_used == spec.pools.blocks.num_blocks_for(start + 4)
    verify.keep(spec.pools, seq_b, verified, num_kept)
    assert seq_b.num_cached_tokens == seq_a.num_cached_tokens == start + num_kept
    assert len(seq_b.block_table) == len(seq_a.block_table)
    assert spec.pools.blocks.num_used == plain.pools.blocks.num_used  # the rejected-only block is free
    torch.testing.assert_close(spec.pools.ssm.recurrent[:, seq_b.ssm_slot],
                               plain.pools.ssm.recurrent[:, seq_a.ssm_slot], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(spec.pools.ssm.conv[:, seq_b.ssm_slot], plain.pools.ssm.conv[:, seq_a.ssm_slot])
    torch.testing.assert_close(spec.decode([seq_b], [77]), plain.decode([seq_a], [77]), rtol=1e-4, atol=1e-4)
    spec.pools.blocks.check_invariants()
    with pytest.raises(ValueError, match="at least the fed token"):
        verify.keep(spec.pools, seq_b, verified, 0)


def _one_hot_rows(picks, vocab):
    logits = torch.full((len(picks), vocab), -5.0)
    logits[torch.arange(len(picks)), torch.tensor(picks)] = 5.0
    return logits


@pytest.mark.parametrize("drafts, picks, expected", [
    ([5, 6, 7], [5, 6, 9, 1], [5, 6, 9]),     # third draft rejected: the sampler's pick replaces it
    ([5, 6, 7], [5, 6, 7, 1], [5, 6, 7, 1]),  # all accepted plus the bonus token
    ([5, 6, 7], [4, 6, 7, 1], [4]),           # first rejected: one token, like a plain decode
    ([8], [8, 3], [8, 3]),
])
def test_greedy_acceptance_rule(tiny, drafts, picks, expected):
    sched = Scheduler(ModelRunner.build(tiny, num_kv_blocks=8, num_ssm_slots=1), NGRAM)
    req = sched.submit(0, [1, 2, 3], {"max_tokens": 8})
    assert spec_step.accept(sched.context(), req, _one_hot_rows(picks, tiny.config.vocab_size), drafts) == expected


def test_sampled_acceptance_draws_once_per_emitted_token_in_order(tiny):
    sched = Scheduler(ModelRunner.build(tiny, num_kv_blocks=8, num_ssm_slots=1), NGRAM)
    req = sched.submit(0, [1, 2, 3], {"max_tokens": 8, "temperature": 1.0, "seed": 4})
    logits = torch.randn(5, tiny.config.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    twin = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=4)
    reference = [int(sample_next(logits[i:i + 1], [params], [twin], [i], sched.eos_ids)[0]) for i in range(2)]
    # Drafts that agree with the first pick only: accept one, emit the second pick, stop.
    emitted = spec_step.accept(sched.context(), req, logits, [reference[0], (reference[1] + 1) % 256, 0, 0])
    assert emitted == reference
    assert torch.equal(req.generator.get_state(), twin.get_state()), "one draw per emitted token"


def test_draft_budget_respects_max_tokens_context_and_free_blocks():
    req = SimpleNamespace(params=SamplingParams(max_tokens=10), num_generated=7, prompt_len=5)
    budget = lambda **kw: spec_step.draft_budget(req, num_drafts=4, **kw)  # noqa: E731
    assert budget(max_context=100, num_free_blocks=9, blocks_for_tokens=lambda n: 0) == 2
    req.num_generated = 9
    assert budget(max_context=100, num_free_blocks=9, blocks_for_tokens=lambda n: 0) == 0
    req.num_generated = 0
    assert budget(max_context=8, num_free_blocks=9, blocks_for_tokens=lambda n: 0) == 2
    assert spec_step.draft_budget(req, num_drafts=1, max_context=100, num_free_blocks=9,
                                  blocks_for_tokens=lambda n: 0) == 1  # the lever caps it
    # One free block, and caching more than 3 tokens needs a second one.
    assert budget(max_context=100, num_free_blocks=1, blocks_for_tokens=lambda n: 1 if n <= 3 else 2) == 2


def test_pending_drafts_are_dropped_with_a_secondary_sync_before_a_mixed_forward(tiny):
    a = (0, repetitive_prompt(5), {"max_tokens": 60})
    b = (1, [7, 8, 9, 10, 11], {"max_tokens": 30})
    c = (2, [random.Random(2).randrange(256) for _ in range(300)], {"max_tokens": 4})
    # Alone, a reuses drafts proposed by its previous step at some tick t: b arrives then, so a
    # holds pending drafts while b prefills (blocked: a is a lone speculative decode), the owed
    # decode at width 2 is a plain one, and c's first chunk fuses with both at t + 2.
    _, alone = run(tiny, {0: [a]}, NGRAM)
    t = min(r.tick for r in spec_rows(alone) if r.detail["reused_pending"])
    arrivals = {0: [a], t: [b], t + 2: [c]}
    off, _ = run(tiny, arrivals, defaults())
    on, rows = run(tiny, arrivals, NGRAM)
    assert on == off
    dropped = [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "drafts_dropped"]
    assert dropped and dropped[0].detail["num_dropped"] > 0
    streams = [r for r in rows if isinstance(r, ev.StreamEvent)]
    syncs = [i for i, r in enumerate(streams) if r.kind == "sync" and r.stream == "secondary"]
    assert syncs, "the mixed forward must wait for the secondary stream"
    records = [r for r in streams[:syncs[0]] if r.kind == "record" and r.stream == "secondary"]
    assert records and records[-1].event_name == "secondary_done"
    chunks = [r for r in rows if isinstance(r, ev.ChunkDecision) and r.request_id == 2]
    assert any(r.path == ev.PATH_MIXED for r in chunks)
    blocked = [r for r in rows if isinstance(r, ev.ChunkDecision) and r.request_id == 1]
    assert blocked[0].mix_blocker == ev.BLOCK_SPECULATION  # b prefilled next to a lone speculative decode


def test_dropped_drafts_leave_nothing_pending(tiny):
    a = (0, repetitive_prompt(5), {"max_tokens": 60})
    b = (1, [7, 8, 9, 10, 11], {"max_tokens": 30})
    c = (2, [random.Random(2).randrange(256) for _ in range(300)], {"max_tokens": 4})
    _, alone = run(tiny, {0: [a]}, NGRAM)
    t = min(r.tick for r in spec_rows(alone) if r.detail["reused_pending"])
    rows: list = []
    runner = ModelRunner.build(tiny, num_kv_blocks=256, num_ssm_slots=4)
    sched = Scheduler(runner, NGRAM, emit=rows.append)
    pending = {0: [a], t: [b], t + 2: [c]}
    held = False
    while not any(isinstance(r, ev.GenericEvent) and r.kind == "drafts_dropped" for r in rows):
        for request in pending.pop(sched.tick, []):
            sched.submit(*request)
        held |= any(r.pending_drafts for r in sched.active)
        assert sched.step()
    assert held, "a speculative step must have left drafts"
    # Right after the mixed tick that dropped the drafts: nothing of them is left.
    assert all(r.pending_drafts_at is None and not r.pending_drafts for r in sched.active)
    while sched.has_work:
        sched.step()
    assert all(not r.pending_drafts for r in sched.done)  # nor on an ended request


@pytest.fixture(scope="module")
def no_mtp_model(hf_checkpoint):
    """A checkpoint without any mtp.* tensor (transformers writes none)."""
    model, _, _ = load_model(hf_checkpoint("base")[1])
    return model


def test_mtp_is_rejected_without_an_mtp_module_and_the_previous_value_kept(no_mtp_model):
    rows: list = []
    sched = Scheduler(ModelRunner.build(no_mtp_model, num_kv_blocks=8, num_ssm_slots=1), NGRAM, emit=rows.append)
    changes = sched.apply_levers(sched.levers.replace(speculation="mtp", kv_blocks_cap=6), source="file", version=3)
    assert sched.levers.speculation == "ngram" and sched.levers.kv_blocks_cap == 6
    assert changes == {"kv_blocks_cap": (0, 6)}
    rejected = [r for r in rows if isinstance(r, ev.LeverChange) and r.status == "rejected"]
    assert len(rejected) == 1
    row = rejected[0]
    assert (row.name, row.old, row.new, row.source, row.file_version) == ("speculation", "ngram", "mtp", "file", 3)
    assert "speculation=mtp needs a multi-token-prediction head" in row.reason
    assert "the loaded model has none (config.json declares no MTP module" in row.reason
    assert sched.apply_levers(sched.levers.replace(speculation="self"), source="file") == \
        {"speculation": ("ngram", "self")}  # an early exit needs no extra weights
    assert not sched.runner.mtp_keep_up


def test_unsupported_kind_at_start_falls_back_to_off(no_mtp_model):
    rows: list = []
    sched = Scheduler(ModelRunner.build(no_mtp_model, num_kv_blocks=8, num_ssm_slots=1),
                      defaults().replace(speculation="mtp"), emit=rows.append)
    assert sched.levers.speculation == "off"
    assert [(r.name, r.status, r.source) for r in rows if isinstance(r, ev.LeverChange)] == \
        [("speculation", "rejected", "init")]


def test_speculation_rejection_is_about_the_model():
    assert speculation_rejection("ngram", SimpleNamespace()) is None
    assert speculation_rejection("off", SimpleNamespace()) is None
    assert speculation_rejection("mtp", SimpleNamespace(has_mtp_head=True)) is None
    assert speculation_rejection("self", SimpleNamespace(has_self_draft=True)) is None
    assert speculation_rejection("mtp", SimpleNamespace(has_self_draft=True)) is not None
    assert "self-speculative draft path" in speculation_rejection("self", SimpleNamespace(has_mtp_head=True))
    with pytest.raises(ValueError, match="speculation"):
        speculation_rejection("eagle", SimpleNamespace())
