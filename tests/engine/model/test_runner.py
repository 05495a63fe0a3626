"""Chunked prefill and the fused mixed forward give the same numbers as whole prefill and separate calls."""
from __future__ import annotations

import random

import pytest
import torch

from engine.cache.kv import KVCacheExhausted
from engine.model.loader import load_model
from engine.model.forward_batch import ForwardBatch, PrefillChunk
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    _, directory = hf_checkpoint("base")
    return load_model(directory)[0]


def prompt_of(length: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_seq(runner: ModelRunner, request_id: int) -> SequenceState:
    seq = SequenceState(request_id)
    runner.pools.admit(seq)
    return seq


def prefill_in_chunks(runner, seq, prompt, cuts) -> torch.Tensor:
    bounds = [0, *cuts, len(prompt)]
    logits = None
    for start, end in zip(bounds, bounds[1:]):
        logits = runner.prefill_chunk(seq, prompt, start, end - start, end == len(prompt))
    return logits


def continue_greedy(runner, seq, logits, steps) -> list[int]:
    tokens = [int(logits.argmax())]
    for _ in range(steps - 1):
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    return tokens


@pytest.mark.parametrize("cut_seed", [0, 1, 2, 3])
def test_chunked_prefill_matches_whole_prefill(model, cut_seed):
    prompt = prompt_of(90, seed=7)
    rng = random.Random(cut_seed)
    cuts = sorted(rng.sample(range(1, len(prompt)), rng.randint(1, 8)))
    if cut_seed == 0:
        cuts = [1, 2, 3, 17, 18, 50, 89]  # 1-token chunks and block-unaligned cuts
    whole = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=1)
    chunked = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=1)
    seq_whole, seq_chunked = new_seq(whole, 0), new_seq(chunked, 0)
    logits_whole = prefill_in_chunks(whole, seq_whole, prompt, [])
    logits_chunked = prefill_in_chunks(chunked, seq_chunked, prompt, cuts)
    assert (logits_whole - logits_chunked).abs().max().item() <= 1e-4
    assert continue_greedy(whole, seq_whole, logits_whole, 64) == \
        continue_greedy(chunked, seq_chunked, logits_chunked, 64)


def test_one_token_chunks_everywhere(model):
    prompt = prompt_of(20, seed=3)
    whole, chunked = (ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=1) for _ in range(2))
    a, b = new_seq(whole, 0), new_seq(chunked, 0)
    expected = prefill_in_chunks(whole, a, prompt, [])
    actual = prefill_in_chunks(chunked, b, prompt, list(range(1, 20)))
    assert (expected - actual).abs().max().item() <= 1e-4


def test_mixed_forward_matches_separate_calls(model):
    """Decode three sequences while a fourth prefills in chunks: fused vs separate, 64 steps."""
    prompts = [prompt_of(n, seed=n) for n in (5, 23, 40)]
    late_prompt = prompt_of(75, seed=99)
    cuts = [0, 9, 16, 33, 51, 75]
    separate, fused = (ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=4) for _ in range(2))

    def start(runner):
        seqs = [new_seq(runner, i) for i in range(3)]
        tokens = [int(runner.prefill_chunk(s, p, 0, len(p), True).argmax()) for s, p in zip(seqs, prompts)]
        return seqs, tokens, new_seq(runner, 3)

    seqs_a, tok_a, late_a = start(separate)
    seqs_b, tok_b, late_b = start(fused)
    history_a, history_b = [list(tok_a)], [list(tok_b)]
    late_tokens_a: list[int] = []
    late_tokens_b: list[int] = []
    for step in range(64):
        chunk = step < len(cuts) - 1
        if chunk:
            offset, length = cuts[step], cuts[step + 1] - cuts[step]
            is_last = cuts[step + 1] == len(late_prompt)
            pre_a = separate.prefill_chunk(late_a, late_prompt, offset, length, is_last)
            dec_a = separate.decode(seqs_a, tok_a)
            chunk_b = PrefillChunk(late_b, late_prompt, offset, length, is_last)
            out = fused.forward(ForwardBatch.mixed(seqs_b, tok_b, chunk_b))
            pre_b, dec_b = out.prefill_logits, out.decode_logits
            assert (pre_a is None) == (pre_b is None)
            if pre_a is not None:
                assert (pre_a - pre_b).abs().max().item() <= 1e-4
                late_tokens_a.append(int(pre_a.argmax()))
                late_tokens_b.append(int(pre_b.argmax()))
        else:
            # The late sequence joins the decode batch once its prompt is done.
            dec_a = separate.decode(seqs_a + [late_a], tok_a + late_tokens_a[-1:])
            dec_b = fused.decode(seqs_b + [late_b], tok_b + late_tokens_b[-1:])
            late_tokens_a.append(int(dec_a[-1].argmax()))
            late_tokens_b.append(int(dec_b[-1].argmax()))
            dec_a, dec_b = dec_a[:-1], dec_b[:-1]
        assert dec_a.shape == dec_b.shape == (3, model.config.vocab_size)
        assert (dec_a - dec_b).abs().max().item() <= 1e-4
        tok_a, tok_b = dec_a.argmax(-1).tolist(), dec_b.argmax(-1).tolist()
        history_a.append(tok_a)
        history_b.append(tok_b)
    assert history_a == history_b
    assert late_tokens_a == late_tokens_b and len(late_tokens_a) > 50


def test_mixed_forward_rows_match_solo_runs(model):
    """Each row of a fused forward equals running that sequence alone (no cross-talk between rows)."""
    prompts = [prompt_of(n, seed=n + 100) for n in (7, 31)]
    fused = ModelRunner.build(model, num_kv_blocks=32, num_ssm_slots=3)
    seqs = [new_seq(fused, i) for i in range(2)]
    tokens = [int(fused.prefill_chunk(s, p, 0, len(p), True).argmax()) for s, p in zip(seqs, prompts)]
    late = prompt_of(20, seed=5)
    late_seq = new_seq(fused, 2)
    out = fused.forward(ForwardBatch.mixed(seqs, tokens, PrefillChunk(late_seq, late, 0, 20, True)))
    pre, dec = out.prefill_logits, out.decode_logits
    for i, (prompt, token) in enumerate(zip(prompts, tokens)):
        solo = ModelRunner.build(model, num_kv_blocks=32, num_ssm_slots=1)
        s = new_seq(solo, 0)
        solo.prefill_chunk(s, prompt, 0, len(prompt), True)
        assert (solo.decode([s], [token])[0] - dec[i]).abs().max().item() <= 1e-4
    solo = ModelRunner.build(model, num_kv_blocks=32, num_ssm_slots=1)
    assert (solo.prefill_chunk(new_seq(solo, 0), late, 0, 20, True) - pre).abs().max().item() <= 1e-4


def test_kv_exhaustion_changes_nothing(model):
    runner = ModelRunner.build(model, num_kv_blocks=3, num_ssm_slots=2)
    a, b = new_seq(runner, 0), new_seq(runner, 1)
    runner.prefill_chunk(a, prompt_of(40, 1), 0, 40, True)  # 3 blocks
    with pytest.raises(KVCacheExhausted):
        runner.prefill_chunk(b, prompt_of(10, 2), 0, 10, True)
    with pytest.raises(KVCacheExhausted):
        runner.forward(ForwardBatch.mixed([a], [1], PrefillChunk(b, prompt_of(10, 2), 0, 10, True)))
    assert b.block_table == [] and b.num_cached_tokens == 0
    assert a.num_cached_tokens == 40 and len(a.block_table) == 3
    runner.pools.blocks.check_invariants()
    runner.pools.release(a)
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 1 and a.ssm_slot is None
    runner.prefill_chunk(b, prompt_of(10, 2), 0, 10, True)


def test_forward_input_errors(model):
    runner = ModelRunner.build(model, num_kv_blocks=4, num_ssm_slots=1)
    seq = new_seq(runner, 0)
    with pytest.raises(ValueError, match="prompt is empty"):
        runner.prefill_chunk(seq, [], 0, 0, True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.prefill_chunk(seq, [1, 96], 0, 2, True)
    with pytest.raises(ValueError, match="offset"):
        runner.prefill_chunk(seq, [1, 2, 3], 1, 2, True)
    with pytest.raises(ValueError, match="admit"):
        runner.decode([SequenceState(5)], [1])
    assert seq.num_cached_tokens == 0 and seq.block_table == []


def test_normalize_ssm_states_bounds_norms(model):
    runner = ModelRunner.build(model, num_kv_blocks=4, num_ssm_slots=1)
    seq = new_seq(runner, 0)
    runner.prefill_chunk(seq, prompt_of(30, 4), 0, 30, True)
    assert runner.pools.normalize(seq, max_norm=1e6) is False
    assert runner.pools.normalize(seq, max_norm=1e-3) is True
    norms = torch.linalg.vector_norm(runner.pools.ssm.recurrent[:, seq.ssm_slot], dim=(-2, -1))
    assert norms.max().item() <= 1e-3 * (1 + 1e-5)


def test_failed_mixed_allocation_rolls_back_decode_blocks(model):
    runner = ModelRunner.build(model, num_kv_blocks=4, num_ssm_slots=2)
    a, b = new_seq(runner, 0), new_seq(runner, 1)
    runner.prefill_chunk(a, prompt_of(48, 1), 0, 48, True)  # exactly 3 full blocks
    with pytest.raises(KVCacheExhausted):
        # a's decode token needs the 4th block, b's 20-token chunk two more: neither may stick.
        runner.forward(ForwardBatch.mixed([a], [1], PrefillChunk(b, prompt_of(20, 2), 0, 20, True)))
    assert len(a.block_table) == 3 and a.num_cached_tokens == 48 and b.block_table == []
    assert runner.pools.blocks.num_used == 3
    runner.pools.blocks.check_invariants()
