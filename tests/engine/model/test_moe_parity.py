"""Qwen3.5-MoE: logits and 20 greedy tokens match transformers' Qwen3_5MoeForCausalLM.

``tiny-moe`` (3-D expert tensors, loaded by transformers as they are) and three configs written
by ``save_pretrained`` (per-expert tensors, stacked by our loader).
"""
from __future__ import annotations

import pytest
import torch

from engine.model.batch import build_batch
from engine.model.config import ConfigError
from engine.model.loader import CheckpointError, load_model
from engine.model.qwen3_5_moe import Qwen35MoeForCausalLM, shard_bounds
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState
from tests.engine.conftest import randomize

transformers = pytest.importorskip("transformers")

MOE_BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
MOE_CONFIGS = {
    "moe_base": {},
    "moe_top4_tied": dict(num_experts=6, num_experts_per_tok=4, tie_word_embeddings=True, num_key_value_heads=4),
    "moe_pattern": dict(num_hidden_layers=5, num_experts=16, num_experts_per_tok=1, moe_intermediate_size=24,
                        layer_types=["full_attention", "linear_attention", "linear_attention",
                                     "full_attention", "linear_attention"]),
}
TOLERANCE = 1e-4  # the dense model's parity tolerance (test_model_parity.py)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def build(name: str):
        if name not in cache:
            if name == "tiny-moe":
                from engine.model.embedded import checkpoint_dir_of
                directory = checkpoint_dir_of("tiny-moe")
                hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            else:
                torch.manual_seed(0)
                config = transformers.Qwen3_5MoeTextConfig(**{**MOE_BASE, **MOE_CONFIGS[name]})
                hf = transformers.Qwen3_5MoeForCausalLM(config).eval()
                randomize(hf, 3)
                directory = tmp_path_factory.mktemp(name)
                hf.save_pretrained(directory)
            cache[name] = (hf, directory)
        return cache[name]

    return build


NAMES = ["tiny-moe", *MOE_CONFIGS]


@pytest.mark.parametrize("name", NAMES)
def test_every_position_logits_match_transformers(moe_checkpoint, name):
    hf, directory = moe_checkpoint(name)
    model, config, _ = load_model(directory)
    assert isinstance(model, Qwen35MoeForCausalLM)
    prompt = torch.randint(0, config.vocab_size, (41,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]  # [L, V]
    runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=2)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    runner.pools.blocks.allocate(seq, len(prompt))
    batch = build_batch((prompt, 0, seq.block_table, seq.ssm_slot), [], runner.kv_block_size)
    actual = model(batch, runner.pools.kv_store, runner.pools.ssm)  # [L, V]
    assert (actual - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_twenty_greedy_tokens_match_transformers_generate(moe_checkpoint, name):
    hf, directory = moe_checkpoint(name)
    model, config, _ = load_model(directory)
    prompt = torch.randint(0, config.vocab_size, (23,), generator=torch.Generator().manual_seed(7)).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                          do_sample=False, pad_token_id=config.vocab_size - 1)
    expected = out[0, len(prompt):].tolist()
    runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=2)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    logits = runner.prefill_chunk(seq, prompt, 0, 16, False)
    logits = runner.prefill_chunk(seq, prompt, 16, len(prompt) - 16, True)  # chunked prompt
    tokens = [int(logits.argmax())]
    while len(tokens) < 20:
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    assert tokens == expected


def test_shard_bounds_split_evenly_or_refuse():
    assert shard_bounds(8, 2) == [(0, 4), (4, 8)]
    assert shard_bounds(8, 1) == [(0, 8)]
    with pytest.raises(ConfigError, match="divisible by 3"):
        shard_bounds(8, 3)


def test_a_rank_loads_only_its_experts(moe_checkpoint):
    _, directory = moe_checkpoint("moe_base")
    full, _, _ = load_model(directory)
    half, _, _ = load_model(directory, ep_rank=1, ep_size=2)
    experts = half.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and (experts.first, experts.end) == (4, 8)
    assert torch.equal(experts.down_proj, full.model.layers[0].mlp.experts.down_proj[4:])


def test_a_world_size_that_does_not_divide_the_experts_fails_at_load(moe_checkpoint):
    _, directory = moe_checkpoint("moe_base")
    with pytest.raises(CheckpointError, match="divisible by 3"):
        load_model(directory, ep_rank=0, ep_size=3)
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        load_model("tiny", ep_rank=0, ep_size=2)


def test_a_qwen3_5_moe_wrapper_config_reads_its_text_config():
    from engine.model.config import ModelConfig

    text = {**{k: v for k, v in MOE_BASE.items() if k != "tie_word_embeddings"}, "model_type": "qwen3_5_moe_text"}
    config = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": True})
    assert config.is_moe and config.num_experts == 8 and config.tie_word_embeddings
    assert config.to_hf_dict()["model_type"] == "qwen3_5_moe_text"
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**text, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="missing field"):
        ModelConfig.from_hf_dict({k: v for k, v in text.items() if k != "moe_intermediate_size"})
