"""Kimi Linear: logits and 20 greedy tokens match transformers' KimiLinearForCausalLM (float32).

tiny-kimi (our names, loaded by transformers as they are) and three configs written by
``save_pretrained`` (Moonshot's layout: block_sparse_moe, per-expert w1/w2/w3, q/k/v_conv1d),
with different ranks, head counts, layer patterns, dense/MoE mixes and routing groups.
"""
from __future__ import annotations

import pytest
import torch

from engine.cache.sequence import SequenceState
from engine.model.batch import build_batch
from engine.model.kimi_linear import KimiLinearForCausalLM
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from tests.engine.model.kimi_checkpoints import KIMI_CONFIGS, build_kimi_checkpoint

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
NAMES = ["tiny-kimi", *KIMI_CONFIGS]


@pytest.fixture(scope="module")
def kimi_checkpoint(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def build(name: str):
        if name not in cache:
            cache[name] = build_kimi_checkpoint(name, tmp_path_factory.mktemp)
        return cache[name]

    return build


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_every_position_logits_match_transformers(kimi_checkpoint, name):
    hf, directory = kimi_checkpoint(name)
    model, config, _ = load_model(directory)
    assert isinstance(model, KimiLinearForCausalLM) and model.is_mla
    for length in (1, 37, 300):
        prompt = _prompt(length, config.vocab_size, length)
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]  # [L, V]
        runner = ModelRunner.build(model, num_kv_blocks=-(-length // 16) + 1, num_ssm_slots=2)
        seq = SequenceState(0)
        runner.pools.admit(seq)
        runner.pools.blocks.allocate(seq, length)
        batch = build_batch((prompt, 0, seq.block_table, seq.ssm_slot), [], runner.kv_block_size)
        actual = model(batch, runner.pools.kv_store, runner.pools.ssm)  # [L, V]
        assert (actual - expected).abs().max().item() <= TOLERANCE, f"prompt of {length}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [1, 23, 300])
def test_twenty_greedy_tokens_match_transformers_generate(kimi_checkpoint, name, length):
    """Whole-prompt prefill, then 20 absorbed-form decode steps over the latent cache."""
    hf, directory = kimi_checkpoint(name)
    model, config, _ = load_model(directory)
    prompt = _prompt(length, config.vocab_size, 100 + length)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                          do_sample=False, pad_token_id=config.vocab_size - 1)
    expected = out[0, length:].tolist()
    runner = ModelRunner.build(model, num_kv_blocks=-(-(length + 20) // 16) + 1, num_ssm_slots=2)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    tokens = [_greedy(runner.prefill_chunk(seq, prompt, 0, length, True), config.eos_token_id)]
    while len(tokens) < 20:
        tokens.append(_greedy(runner.decode([seq], [tokens[-1]])[0], config.eos_token_id))
    assert tokens == expected


def _greedy(logits: torch.Tensor, eos: int | None) -> int:
    """argmax with EOS masked, as generate's min_new_tokens does."""
    if eos is not None:
        logits = logits.clone()
        logits[eos] = float("-inf")
    return int(logits.argmax())


def test_latent_cache_keeps_one_row_per_token_and_layer(kimi_checkpoint):
    """The cache's block bytes are the latent's (r + rope per MLA layer), not per-head K/V."""
    _, directory = kimi_checkpoint("tiny-kimi")
    model, config, _ = load_model(directory)
    runner = ModelRunner.build(model, num_kv_blocks=4, num_ssm_slots=1)
    mla_layers = len(config.full_attention_layers)
    assert runner.pools.fp_block_bytes == mla_layers * 16 * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    assert runner.pools.kv_bytes_total == 4 * runner.pools.fp_block_bytes
    assert config.full_kv_width == 4 * config.latent_dim  # tiny-kimi: 320 per-head values vs an 80-value row
