"""Chunked MLA prefill over cached latents equals a whole-prompt forward (layer level and model level).

The edge cases vLLM's MLA chunked prefill got wrong or disabled: a chunk with no cached
context, a context longer than one gathered sub-chunk, a batch of more than one sequence
(a chunk mixed with other sequences' decode rows over the same cache), uneven sub-chunk ends.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.cache.latent_store import LatentKVStore
from engine.cache.sequence import SequenceState
from engine.model.batch import build_batch
from engine.model.forward_batch import ForwardBatch, PrefillChunk
from engine.model.kimi_config import KimiConfig
from engine.model.loader import load_model
from engine.model.mla import LatentAttention
from engine.model.mla_prefill import attention_with_lse, chunk_over_context, merge_partials
from engine.model.runner import ModelRunner

BLOCK = 4
CONFIG = KimiConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
                    kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10, linear_num_heads=2,
                    linear_head_dim=8, layer_types=("full_attention",), mlp_layer_types=("dense",))


@settings(max_examples=40, deadline=None)
@given(keys=st.integers(2, 40), cut=st.data(), queries=st.integers(1, 6), seed=st.integers(0, 1000))
def test_merging_two_partials_is_one_softmax(keys, cut, queries, seed):
    split = cut.draw(st.integers(1, keys - 1))
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, d, generator=gen) for n, d in ((queries, 5), (keys, 5), (keys, 3)))
    full, full_lse = attention_with_lse(q, k, v, 0.4)
    a, lse_a = attention_with_lse(q, k[:, :split], v[:, :split], 0.4)
    b, lse_b = attention_with_lse(q, k[:, split:], v[:, split:], 0.4)
    merged, lse = merge_partials(a, lse_a, b, lse_b)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sub_chunk", [1, 3, 7, 64])
def test_chunk_over_context_matches_one_causal_softmax(sub_chunk):
    gen = torch.Generator().manual_seed(sub_chunk)
    context, length = 19, 6
    q = torch.randn(2, length, 5, generator=gen)
    k, v = torch.randn(2, context + length, 5, generator=gen), torch.randn(2, context + length, 3, generator=gen)
    calls = []

    def read(first, end):
        calls.append((first, end))
        return k[:, first:end], v[:, first:end]

    out = chunk_over_context(q, k[:, context:], v[:, context:], context, read, 0.3, sub_chunk)
    expected, _ = attention_with_lse(q, k, v, 0.3, causal_offset=context)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert all(end - first <= sub_chunk for first, end in calls)  # bounded gathers
    assert [c for pair in calls for c in pair][0] == 0 and calls[-1][1] == context


def _layer(seed: int = 0) -> LatentAttention:
    torch.manual_seed(seed)
    layer = LatentAttention(CONFIG, 0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() > 1 else 1.0) + (param.dim() == 1))
    layer.fuse()
    return layer


def _run_chunks(layer, x, cuts, store, table, sub_chunk):
    """Prefill x [L, hidden] in chunks ending at ``cuts``; returns the attention outputs [L, hidden]."""
    layer.context_sub_chunk = sub_chunk
    outs, start = [], 0
    for end in cuts:
        batch = build_batch(([0] * (end - start), start, table, 0), [], BLOCK)
        outs.append(layer(x[start:end], batch, store))
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("cuts, sub_chunk", [
    ([5], 4),                  # no cached context: the whole prompt in one chunk
    ([1, 2, 3, 23], 4),        # one-token chunks first, then a long one
    ([8, 16, 23], 3),          # block-aligned chunks, contexts of 8 and 16 over sub-chunks of 3
    ([7, 23], 100),            # the context fits one sub-chunk
    ([11, 12, 23], 1),         # every context position its own sub-chunk
])
def test_chunked_layer_prefill_matches_whole_prompt(cuts, sub_chunk):
    layer = _layer()
    length = cuts[-1]
    x = torch.randn(length, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3))
    table = list(range(-(-length // BLOCK)))
    whole = _run_chunks(layer, x, [length], LatentKVStore([0], len(table), BLOCK, CONFIG.latent_dim), table, 4)
    chunked = _run_chunks(layer, x, cuts, LatentKVStore([0], len(table), BLOCK, CONFIG.latent_dim), table,
                          sub_chunk)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)


def test_batch_of_chunk_and_decode_rows_matches_each_sequence_alone():
    """A chunk of sequence A with cached context, fused with decode rows of B and C (other block tables)."""
    layer = _layer(1)
    layer.context_sub_chunk = 3
    gen = torch.Generator().manual_seed(4)
    lengths = {"a": 14, "b": 9, "c": 6}
    xs = {name: torch.randn(n + 1, CONFIG.hidden_size, generator=gen) for name, n in lengths.items()}
    tables = {"a": [0, 1, 2, 3, 4], "b": [5, 6, 7], "c": [8, 9]}  # a's chunk reaches position 18
    store = LatentKVStore([0], 10, BLOCK, CONFIG.latent_dim)
    solo = {}
    for name, n in lengths.items():  # each alone: the prompt up to n-1, then its last row
        _run_chunks(layer, xs[name], [n], store, tables[name], 3)
        if name == "a":
            batch = build_batch(([0] * 5, n, tables[name], 0), [], BLOCK)
            solo[name] = layer(torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(9)),
                               batch, store)
        else:
            batch = build_batch(None, [(0, n, tables[name], 0)], BLOCK)
            solo[name] = layer(xs[name][n:n + 1], batch, store)
    a_chunk = torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(9))
    fused = build_batch(([0] * 5, lengths["a"], tables["a"], 0),
                        [(0, lengths["b"], tables["b"], 0), (0, lengths["c"], tables["c"], 0)], BLOCK)
    out = layer(torch.cat([a_chunk, xs["b"][-1:], xs["c"][-1:]]), fused, store)
    torch.testing.assert_close(out[:5], solo["a"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[5], solo["b"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[6], solo["c"][0], rtol=1e-4, atol=1e-5)


def test_absorbed_decode_equals_expanded_decode():
    layer = _layer(2)
    store = LatentKVStore([0], 8, BLOCK, CONFIG.latent_dim)
    gen = torch.Generator().manual_seed(5)
    for name, (n, table) in {"a": (13, [0, 1, 2, 3]), "b": (5, [4, 5])}.items():
        _run_chunks(layer, torch.randn(n, CONFIG.hidden_size, generator=gen), [n], store, table, 4)
    batch = build_batch(None, [(0, 13, [0, 1, 2, 3], 0), (0, 5, [4, 5], 0)], BLOCK)
    q, latent = layer._project(torch.randn(2, CONFIG.hidden_size, generator=gen))
    store.write(0, batch.kv_slots, latent)
    torch.testing.assert_close(layer.absorbed_decode(q, batch, store), layer.expanded_decode(q, batch, store),
                               rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_kimi():
    model, config, _ = load_model("tiny-kimi")
    return model, config


def _greedy_run(model, prompt, chunk, steps=12, decode_others=()):
    """Prefill ``prompt`` in chunks of ``chunk`` tokens, each fused with a decode row of every other
    sequence in ``decode_others`` (prompts prefilled first); then ``steps`` greedy tokens."""
    runner = ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=4)
    others = []
    for i, other in enumerate(decode_others):
        seq = SequenceState(10 + i)
        runner.pools.admit(seq)
        others.append([seq, int(runner.prefill_chunk(seq, other, 0, len(other), True).argmax())])
    seq = SequenceState(0)
    runner.pools.admit(seq)
    offset = 0
    while offset < len(prompt):
        length = min(chunk, len(prompt) - offset)
        is_last = offset + length == len(prompt)
        out = runner.forward(ForwardBatch.mixed([s for s, _ in others], [t for _, t in others],
                                                PrefillChunk(seq, prompt, offset, length, is_last)))
        logits, decoded = out.prefill_logits, out.decode_logits
        for pair, row in zip(others, decoded):
            pair[1] = int(row.argmax())
        offset += length
    tokens = [int(logits.argmax())]
    while len(tokens) < steps:
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    return tokens


@pytest.mark.parametrize("chunk", [16, 48, 112])
def test_chunked_prompt_mixed_with_decodes_gives_the_whole_prompt_tokens(tiny_kimi, chunk):
    model, config = tiny_kimi
    gen = torch.Generator().manual_seed(chunk)
    prompt = torch.randint(0, 256, (250,), generator=gen).tolist()
    others = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (30, 70)]
    assert _greedy_run(model, prompt, chunk, decode_others=others) == _greedy_run(model, prompt, len(prompt))
