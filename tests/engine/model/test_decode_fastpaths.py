"""Decode through the prepacked weights, and the bf16 path, against the plain fp32 forward."""
from __future__ import annotations

import pytest
import torch

from engine.model import layers
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState

PROMPT_LENGTHS = (40, 77, 130)
# bf16 tolerance on the tiny model (logits std ~0.57): teacher-forced logits within 0.15 of fp32
# (measured max 0.04), and the greedy choice equal at >= 90% of the steps (near-ties may flip).
BF16_MAX_LOGIT_ERROR = 0.15
BF16_MIN_GREEDY_AGREEMENT = 0.9


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _run(model, dtype: torch.dtype, steps: int, forced: list[list[int]] | None = None):
    """Prefill three prompts, then ``steps`` decode steps at batch 3: (tokens per step, logits per step).

    ``forced``: feed these tokens instead of the greedy ones (teacher forcing), so two
    dtypes are compared on the same inputs even where a near-tie flips a choice.
    """
    runner = ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=4, dtype=dtype)
    seqs, first, logits = [], [], []
    for i, prompt in enumerate(_prompts(model.config.vocab_size)):
        seq = SequenceState(i)
        runner.pools.admit(seq)
        row = runner.prefill_chunk(seq, prompt, 0, len(prompt), True)
        seqs.append(seq)
        first.append(int(row.argmax()))
        logits.append(row[None].float())
    tokens = [first]
    for step in range(steps):
        feed = forced[step] if forced is not None else tokens[-1]
        out = runner.decode(seqs, feed)  # [3, V]
        logits.append(out.float())
        tokens.append(out.argmax(-1).tolist())
    return tokens, logits


def test_decode_prepack_greedy_equals_plain(monkeypatch):
    """fp32: decode rows through the oneDNN-packed copies give the plain path's tokens and logits."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    monkeypatch.setattr(layers, "PREPACK_ENABLED", True)
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)  # the tiny model is below the size limit
    model = load_model("tiny")[0]
    assert model.fused_lm_head.packed is not None and model.model.layers[0].mlp.packed_gate is not None
    monkeypatch.setattr(layers, "DECODE_PREPACK_ENABLED", True)
    packed_tokens, packed_logits = _run(model, torch.float32, 20)
    monkeypatch.setattr(layers, "DECODE_PREPACK_ENABLED", False)
    plain_tokens, plain_logits = _run(model, torch.float32, 20)
    assert packed_tokens == plain_tokens
    for packed, plain in zip(packed_logits, plain_logits):
        assert torch.allclose(packed, plain, atol=1e-4)


def test_decode_prepack_switch_routes_decode_rows(monkeypatch):
    """The switch really changes the path a decode-size input takes (and prefill keeps its own)."""
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    monkeypatch.setattr(layers, "PREPACK_ENABLED", True)
    linear = layers.FusedLinear(torch.randn(64, 32))
    if linear.packed is None:
        pytest.skip("no oneDNN")
    monkeypatch.setattr(layers, "DECODE_PREPACK_ENABLED", True)
    assert linear.can_pack(torch.randn(8, 32))
    monkeypatch.setattr(layers, "DECODE_PREPACK_ENABLED", False)
    assert not linear.can_pack(torch.randn(8, 32))
    assert linear.can_pack(torch.randn(layers.PACKED_MIN_ROWS, 32))


def test_bf16_decode_meets_its_tolerance():
    """bf16 weights and activations (fp32 linear-attention state): close logits, greedy agreement."""
    fp32_model = load_model("tiny", dtype=torch.float32)[0]
    bf16_model = load_model("tiny", dtype=torch.bfloat16)[0]
    assert next(bf16_model.parameters()).dtype == torch.bfloat16
    tokens, fp32_logits = _run(fp32_model, torch.float32, 24)
    bf16_tokens, bf16_logits = _run(bf16_model, torch.bfloat16, 24, forced=tokens[:24])
    errors = [(a - b).abs().max().item() for a, b in zip(fp32_logits, bf16_logits)]
    assert max(errors) <= BF16_MAX_LOGIT_ERROR, errors
    agree = [x == y for fp32_step, bf16_step in zip(tokens, bf16_tokens) for x, y in zip(fp32_step, bf16_step)]
    assert sum(agree) / len(agree) >= BF16_MIN_GREEDY_AGREEMENT


def test_bf16_weights_prepack_only_where_onednn_runs_bf16(monkeypatch):
    """On a CPU with native bf16 (AMX / AVX512-BF16) the bf16 copy is packed and matches F.linear."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    monkeypatch.setattr(layers, "PREPACK_ENABLED", True)
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    weight = torch.randn(96, 64).bfloat16()
    linear = layers.FusedLinear(weight)
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (linear.packed is not None) == supported
    x = torch.randn(8, 64).bfloat16()
    expected = torch.nn.functional.linear(x.float(), weight.float())
    assert torch.allclose(linear(x).float(), expected, atol=0.1, rtol=0.02)
    assert not linear.can_pack(x.float())  # an fp32 input never meets a bf16 packed weight
