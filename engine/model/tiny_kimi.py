"""The embedded ``tiny-kimi`` model: a seeded random Kimi Linear checkpoint written once to a cache dir.

Built like ``tiny`` and ``tiny-moe`` (same byte tokenizer, same atomic cache write): KDA and MLA
layers alternating, a dense first MLP (``first_k_dense_replace = 1``) and sparse ones after it
with 8 experts in 4 groups (2 groups kept, 2 experts per token) plus a shared expert. Its MLA
caches a latent row of 64 + 16 = 80 values per token and layer where per-head K/V would be
4 x (48 + 32) = 320. Eight experts split evenly over 1, 2, 4 or 8 expert-parallel ranks.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.model.kimi_config import KimiConfig
from engine.model.kimi_linear import KimiLinearForCausalLM
from engine.model.tiny import ensure_cached_checkpoint, random_init, tokenizer_tokens
from engine.model.tokenizer import EOS

TINY_KIMI_VERSION = 1  # bump when the config or the init changes, so caches are rebuilt
TINY_KIMI_SEED = 2718
TINY_KIMI_CONFIG = KimiConfig(
    vocab_size=272, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    linear_num_heads=4, linear_head_dim=32, linear_conv_kernel_dim=4,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, num_shared_experts=1,
    routed_scaling_factor=2.446, n_group=4, topk_group=2, tie_word_embeddings=False, eos_token_id=256,
)
MARKER = "chunkscope_tiny_kimi.json"


def ensure_tiny_kimi_checkpoint() -> Path:
    """Return the tiny-kimi checkpoint directory, creating it on first use (atomically)."""
    return ensure_cached_checkpoint("tiny-kimi", MARKER, _marker(), _build_tiny_kimi)


def kimi_init(model: KimiLinearForCausalLM, seed: int) -> None:
    """``random_init``'s statistics, with the plain-scale norms near 1 and a varied router bias.

    (random_init draws 1-D weights around 0: right for Qwen's zero-centred norms, which add 1.)
    """
    random_init(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))


def _build_tiny_kimi() -> KimiLinearForCausalLM:
    torch.manual_seed(TINY_KIMI_SEED)
    model = KimiLinearForCausalLM(TINY_KIMI_CONFIG)
    kimi_init(model, TINY_KIMI_SEED)
    return model


def _marker() -> dict:
    return {"version": TINY_KIMI_VERSION, "seed": TINY_KIMI_SEED, "eos": EOS, "special_tokens": tokenizer_tokens(),
            "config": TINY_KIMI_CONFIG.to_hf_dict()}
