"""The embedded ``tiny-moe`` model: a seeded random Qwen3.5-MoE checkpoint written once to a cache dir.

Built like ``tiny`` (same tokenizer, same init statistics, same atomic cache write), with a
sparse MoE block in every layer: 8 experts, 2 per token, experts stored as 3-D tensors.
Eight experts split evenly over 1, 2, 4 or 8 expert-parallel ranks.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.model.config import ModelConfig
from engine.model.qwen3_5_moe import Qwen35MoeForCausalLM
from engine.model.tiny import ensure_cached_checkpoint, random_init, tokenizer_tokens
from engine.model.tokenizer import EOS

TINY_MOE_VERSION = 1  # bump when the config or the init changes, so caches are rebuilt
TINY_MOE_SEED = 4321
TINY_MOE_CONFIG = ModelConfig(
    vocab_size=272, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, tie_word_embeddings=False, eos_token_id=256,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=128,
)
MARKER = "chunkscope_tiny_moe.json"


def ensure_tiny_moe_checkpoint() -> Path:
    """Return the tiny-moe checkpoint directory, creating it on first use (atomically)."""
    return ensure_cached_checkpoint("tiny-moe", MARKER, _marker(), _build_tiny_moe)


def _build_tiny_moe() -> Qwen35MoeForCausalLM:
    torch.manual_seed(TINY_MOE_SEED)
    model = Qwen35MoeForCausalLM(TINY_MOE_CONFIG)
    random_init(model, TINY_MOE_SEED)
    return model


def _marker() -> dict:
    return {"version": TINY_MOE_VERSION, "seed": TINY_MOE_SEED, "eos": EOS, "special_tokens": tokenizer_tokens(),
            "config": TINY_MOE_CONFIG.to_hf_dict()}
