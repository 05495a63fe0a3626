"""Kimi Linear config.json: Moonshot's spelling and transformers', and the variants refused by name."""
from __future__ import annotations

import json

import pytest

from engine.model.config import ConfigError
from engine.model.kimi_config import KimiConfig
from engine.model.loader import CheckpointError, load_model
from engine.model.tiny_kimi import TINY_KIMI_CONFIG

MOONSHOT = {  # the shape of Moonshot's own config.json (Kimi-Linear-48B-A3B), sized down
    "model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
    "kv_lora_rank": 8, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_expert_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 2, "moe_layer_freq": 1, "model_max_length": 4096,
    "eos_token_id": [99], "linear_attn_config": {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4,
                                                 "kda_layers": [1, 2, 3], "full_attn_layers": [4]}}


def test_moonshot_spelling():
    config = KimiConfig.from_hf_dict(MOONSHOT)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    assert (config.num_experts_per_tok, config.n_group, config.max_position_embeddings, config.eos_token_id) == \
        (2, 2, 4096, 99)
    assert config.conv_dim == 3 * 16 and config.latent_dim == 12 and config.full_kv_width == 2 * (12 + 8)


def test_transformers_spelling_round_trips():
    assert KimiConfig.from_hf_dict(json.loads(json.dumps(TINY_KIMI_CONFIG.to_hf_dict()))) == TINY_KIMI_CONFIG


@pytest.mark.parametrize("change, match", [
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"moe_router_activation_func": "softmax"}, "sigmoid only"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_key_value_heads": 1}, "must equal num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_token": 9}, "exceeds"),
    ({"num_expert_group": 3}, "groups"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"linear_attn_config": {"head_dim": 8, "num_heads": 2, "kda_layers": [1, 2], "full_attn_layers": [4]}},
     "leaves layer 3"),
    ({"linear_attn_config": {"head_dim": 8, "num_heads": 2, "kda_layers": [1, 2, 3], "full_attn_layers": [5]}},
     "outside"),
])
def test_unsupported_or_broken_configs_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        KimiConfig.from_hf_dict({**MOONSHOT, **change})


def test_a_missing_field_is_named():
    with pytest.raises(ConfigError, match="missing field.*kv_lora_rank"):
        KimiConfig.from_hf_dict({k: v for k, v in MOONSHOT.items() if k != "kv_lora_rank"})


def test_loader_names_a_missing_tensor(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MOONSHOT))
    from safetensors.torch import save_file
    import torch
    save_file({"model.embed_tokens.weight": torch.zeros(100, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.0.self_attn.q_proj.weight"):
        load_model(tmp_path)
