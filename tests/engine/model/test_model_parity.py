"""Whole-prompt logits and greedy continuations match transformers' Qwen3_5ForCausalLM."""
from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState


def run_prompt(runner: ModelRunner, prompt: list[int], request_id: int = 0) -> tuple[SequenceState, torch.Tensor]:
    seq = SequenceState(request_id)
    runner.pools.admit(seq)
    logits = runner.prefill_chunk(seq, prompt, 0, len(prompt), True)
    return seq, logits


def greedy(runner: ModelRunner, seq: SequenceState, first_logits: torch.Tensor, steps: int) -> list[int]:
    tokens = [int(first_logits.argmax())]
    for _ in range(steps - 1):
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    return tokens


@pytest.mark.parametrize("name", ["base", "tied_mha", "pattern"])  # conftest.CONFIGS
def test_whole_prompt_logits_match_transformers(hf_checkpoint, name):
    hf_model, directory = hf_checkpoint(name)
    model, config, _ = load_model(directory)
    prompt = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert _max_logit_error(hf_model, model, prompt) <= 1e-4


def _max_logit_error(hf_model, model, prompt: list[int]) -> float:
    """Largest |ours - transformers| over every position's logits of one whole-prompt forward.

    Every position, not just the last: 1-row-of-logits chunks would hide errors in earlier rows,
    so the full forward runs through the model directly.
    """
    from engine.model.batch import build_batch

    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]  # [L, V]
    runner = ModelRunner.build(model, num_kv_blocks=-(-len(prompt) // 16) + 1, num_ssm_slots=2)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    runner.pools.blocks.allocate(seq, len(prompt))
    batch = build_batch((prompt, 0, seq.block_table, seq.ssm_slot), [], runner.kv_block_size)
    actual = model(batch, runner.pools.kv_store, runner.pools.ssm)  # [L, V]
    return (actual - expected).abs().max().item()


@pytest.mark.parametrize("length", [128, 150])  # a bucket exactly, and padded up to 160 rows
def test_prepacked_prefill_logits_match_transformers(hf_checkpoint, monkeypatch, length):
    """The oneDNN path (padded rows, SiLU / product fused into the MLP GEMMs) at every position."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    from engine.model import layers
    monkeypatch.setattr(layers, "PREPACK_ENABLED", True)
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)  # the test checkpoints are far below the size limit
    hf_model, directory = hf_checkpoint("base")
    model, config, _ = load_model(directory)
    assert model.model.layers[0].mlp.packed_gate is not None
    prompt = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    assert _max_logit_error(hf_model, model, prompt) <= 1e-4


@pytest.mark.parametrize("length", [1, 5, 16, 33, 70])
def test_greedy_continuation_matches_transformers_generate(hf_checkpoint, length):
    hf_model, directory = hf_checkpoint("base")
    model, config, _ = load_model(directory)
    prompt = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        # An explicit all-ones mask: otherwise generate treats prompt tokens equal to pad as padding.
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32, pad_token_id=config.vocab_size - 1)
    expected = out[0, length:].tolist()
    runner = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=2)
    seq, logits = run_prompt(runner, prompt)
    assert greedy(runner, seq, logits, 32) == expected
