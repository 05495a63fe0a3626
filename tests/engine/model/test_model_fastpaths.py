"""The decode fast paths (in-place pool views, the fused [k; q] read) equal the plain recurrence."""
from __future__ import annotations

import os

import pytest
import torch

from engine.model.batch import build_batch
from engine.model.gdn import chunked_gated_delta_rule, recurrent_gated_delta_step
from engine.model import layers
from engine.model.layers import PACKED_MIN_ROWS, FusedLinear
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState


def naive_step(q, k, v, g, beta, state):
    """The textbook one-token rule, out of place: decay, delta against the decayed state, write, read."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + torch.einsum("bhk,bhv->bhkv", k, delta)
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def random_inputs(batch: int, heads: int, key_dim: int, value_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, heads, key_dim, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, heads, value_dim, generator=gen)
    g = -torch.rand(batch, heads, generator=gen)
    beta = torch.rand(batch, heads, generator=gen)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seed", [0, 1])
def test_in_place_step_matches_naive_rule(seed):
    q, k, v, g, beta, state = random_inputs(5, 3, 8, 6, seed)
    expected_out, expected_state = naive_step(q, k, v, g, beta, state)
    pool = torch.zeros(9, 3, 8, 6)
    pool[2:7] = state
    out = recurrent_gated_delta_step(q, k, v, g, beta, pool[2:7])  # a view: updated in place
    assert torch.allclose(out, expected_out, atol=1e-5)
    assert torch.allclose(pool[2:7], expected_state, atol=1e-5)
    assert pool[:2].abs().sum() == 0 and pool[7:].abs().sum() == 0  # neighbours untouched


def test_chunked_rule_matches_token_by_token():
    """The prefill chunk form over 70 tokens (two chunks, one padded) equals 70 one-token steps."""
    q, k, v, g, beta, state = random_inputs(70, 2, 8, 6, seed=3)  # token axis first here
    out, final = chunked_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          g.t(), beta.t(), state[0].clone(), chunk_size=64)
    step_state = state[0][None].clone()
    for t in range(70):
        step_out, step_state = naive_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                          step_state)
        assert torch.allclose(out[:, t], step_out[0], atol=1e-4)
    assert torch.allclose(final, step_state[0], atol=1e-4)


@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 300, 513])
def test_fused_linear_matches_plain_linear(rows, monkeypatch):
    """The oneDNN-prepacked path (many rows, padded to a bucket) and the MKL path (few rows) both equal F.linear."""
    monkeypatch.setattr(layers, "PREPACK_ENABLED", True)
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 80, generator=gen)
    layer = FusedLinear(weight, bias)
    if torch.backends.mkldnn.is_available():
        assert layer.packed is not None  # float32 on CPU: the prefill copy exists
    out = layer(x)
    assert out.shape == (rows, 96)
    assert torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-4)


def test_packed_row_buckets_are_few_and_tight():
    """Bucketing bounds the shapes oneDNN sees (its per-shape state grew memory) for <= 12.5% padding."""
    buckets = {layers.packed_rows(rows) for rows in range(PACKED_MIN_ROWS, 4097)}
    assert len(buckets) <= 8 * 5 + 1  # 8 per octave, 128 .. 4096
    for rows in range(PACKED_MIN_ROWS, 4097):
        assert rows <= layers.packed_rows(rows) <= rows * 1.125


def test_prepacking_follows_the_env_override():
    """On by default for big float32 CPU weights; CHUNKSCOPE_ONEDNN_PREPACK=0 turns it off."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    expected = os.environ.get("CHUNKSCOPE_ONEDNN_PREPACK", "1") != "0"
    assert layers.PREPACK_ENABLED == expected
    assert (FusedLinear(torch.randn(1024, 256)).packed is not None) == expected
    assert FusedLinear(torch.randn(8, 4)).packed is None  # too small: oneDNN's overhead would lose


def test_fused_linear_does_not_prepack_other_dtypes():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    layer = FusedLinear(weight)
    assert layer.packed is None
    x = torch.randn(PACKED_MIN_ROWS, 4, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight))


def test_consecutive_slot_range_is_detected():
    decodes = [(1, 0, [0], 3), (1, 0, [1], 4), (1, 0, [2], 5)]
    assert build_batch(None, decodes, 16).decode.slot_range == (3, 6)
    assert build_batch(None, decodes[::-1], 16).decode.slot_range is None
    assert build_batch(None, [decodes[0], decodes[2]], 16).decode.slot_range is None


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    _, directory = hf_checkpoint("base")
    return load_model(directory)[0]


def test_decode_logits_do_not_depend_on_slot_order(model):
    """Gathered (shuffled / gapped slots) and in-place (consecutive slots) decode give the same logits."""
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 1], [2, 2]]

    def run(order: list[int], steps: int = 6) -> list[torch.Tensor]:
        runner = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=5)
        spare = SequenceState(99)
        runner.pools.admit(spare)  # slot 0 taken, so the others start at 1
        seqs = []
        for i, prompt in enumerate(prompts):
            seq = SequenceState(i)
            runner.pools.admit(seq)
            runner.prefill_chunk(seq, prompt, 0, len(prompt), True)
            seqs.append(seq)
        batch_seqs = [seqs[i] for i in order]
        tokens, history = [1] * len(order), []
        for _ in range(steps):
            logits = runner.decode(batch_seqs, tokens)
            history.append(logits[torch.tensor(order).argsort()])  # back to prompt order
            tokens = logits.argmax(-1).tolist()
        return history

    in_place = run([0, 1, 2, 3])
    for order in ([3, 1, 0, 2], [0, 2, 3, 1]):
        for a, b in zip(in_place, run(order)):
            assert (a - b).abs().max().item() <= 1e-5


def test_logits_rows_subset_equals_full_forward_rows(model):
    """The last layer skips its MLP for rows without logits; the kept rows' logits are unchanged."""
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(40)]

    def forward(rows):
        runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=1)
        seq = SequenceState(0)
        runner.pools.admit(seq)
        runner.pools.blocks.allocate(seq, len(prompt))
        batch = build_batch((prompt, 0, seq.block_table, seq.ssm_slot), [], runner.kv_block_size)
        return model(batch, runner.pools.kv_store, runner.pools.ssm, rows), runner

    full, full_runner = forward(None)  # [40, V]
    rows = torch.tensor([39, 5, 17])
    subset, subset_runner = forward(rows)  # [3, V]
    assert subset.shape == (3, model.config.vocab_size)
    assert (subset - full[rows]).abs().max().item() <= 1e-5
    # No row dropped before the mixers: the caches hold the same state either way.
    assert torch.equal(subset_runner.pools.ssm.recurrent, full_runner.pools.ssm.recurrent)
    empty, _ = forward(torch.tensor([], dtype=torch.long))
    assert empty.shape == (0, model.config.vocab_size)
