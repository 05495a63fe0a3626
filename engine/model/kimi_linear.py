"""Kimi Linear (``KimiLinearForCausalLM``): KDA + MLA layers, dense and sparse MLPs, on the engine's caches.

The decoder is Qwen3.5's shape (pre-norm mixer, residual, pre-norm MLP, residual; embeddings,
final norm, LM head) with other parts: plain-scale RMSNorms, Kimi Delta Attention for the
``linear_attention`` layers (state in the SSM pool, kda.py), multi-head latent attention for
the ``full_attention`` layers (one latent row per token in the paged latent cache, mla.py), and
``first_k_dense_replace`` dense SwiGLU MLPs before the sparse ones (kimi_moe.py). It reuses the
MoE model's forward, its expert parallelism and its checkpoint stacking of per-expert tensors.

Checkpoints come in Moonshot's layout (what transformers' ``save_pretrained`` writes too):
``block_sparse_moe.*`` for every MLP, ``experts.{e}.w1/w3/w2``, separate ``q/k/v_conv1d`` and
the forget gate's tensors directly under ``self_attn``; ``read_checkpoint_tensor`` maps each of
our (transformers' in-memory) names to them.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from engine.model.config import ConfigError
from engine.model.kda import KimiDeltaAttention
from engine.model.kimi_config import KimiConfig
from engine.model.kimi_moe import KimiMoeBlock
from engine.model.layers import SwiGLU
from engine.model.norms import RMSNorm
from engine.model.mla import LatentAttention
from engine.model.qwen3_5 import DecoderLayer
from engine.model.qwen3_5_moe import ForwardTimings, Qwen35MoeForCausalLM

# Our name -> the checkpoint's, tried after the name itself (first hit wins).
_RENAMES = (
    (re.compile(r"\.mlp\."), ".block_sparse_moe."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
)
_CONV = ".self_attn.conv1d.weight"


class NoRotary:
    """Kimi's MLA applies no rotary (the KDA layers carry position): the decoder's cos / sin are None."""

    @staticmethod
    def cos_sin(positions: torch.Tensor, dtype: torch.dtype) -> tuple[None, None]:
        return None, None


class KimiDecoderLayer(DecoderLayer):
    """Both mixers sit under ``self_attn`` (HF names); the norms are plain-scale RMSNorms."""

    def __init__(self, config: KimiConfig, layer_id: int, linear_index: int | None, make_mlp):
        nn.Module.__init__(self)
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        self.self_attn = (KimiDeltaAttention(config, linear_index) if self.is_linear
                          else LatentAttention(config, layer_id))
        self.mlp = make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, normed, batch, kv, pool, rotary, cos, sin) -> torch.Tensor:
        return self.self_attn(normed, batch, pool) if self.is_linear else self.self_attn(normed, batch, kv)

    def fuse(self) -> None:
        for part in (self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm):
            part.fuse()


class KimiLinearForCausalLM(Qwen35MoeForCausalLM):
    """Forward over a PackedBatch; latents go to the LatentKVStore, KDA state to the SSM pool."""

    is_mla = True  # full-attention layers cache compressed latents, not per-head K/V
    layer_class = KimiDecoderLayer
    norm_class = RMSNorm
    per_expert_names = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

    def __init__(self, config: KimiConfig, ep_rank: int = 0, ep_size: int = 1):
        if not isinstance(config, KimiConfig):
            raise ConfigError("KimiLinearForCausalLM needs a KimiConfig")
        super().__init__(config, ep_rank, ep_size)

    @staticmethod
    def make_rotary(config: KimiConfig) -> NoRotary:
        return NoRotary()

    @staticmethod
    def make_moe_block(config: KimiConfig, layer_id: int, bounds: list[tuple[int, int]], rank: int,
                       timings: ForwardTimings) -> nn.Module:
        if config.mlp_layer_types[layer_id] == "dense":
            return SwiGLU(config.hidden_size, config.intermediate_size)
        return KimiMoeBlock(config, bounds, rank, timings)

    def read_checkpoint_tensor(self, stored_name: str, read: Callable[[str], torch.Tensor | None]):
        """Our tensor ``stored_name`` from the checkpoint as stored, renamed, or assembled; None: not found.

        The short convolution is stored as three per-projection kernels (q, k, v) when not fused;
        the experts per expert (``w1`` gate, ``w3`` up, ``w2`` down, stacked by the MoE model).
        """
        names = [stored_name] + [pattern.sub(target, stored_name) for pattern, target in _RENAMES
                                 if pattern.search(stored_name)]
        for name in names:
            tensor = super().read_checkpoint_tensor(name, read)
            if tensor is None:
                tensor = read(name)
            if tensor is None and name.endswith(_CONV):
                base = name[: -len("conv1d.weight")]
                parts = [read(f"{base}{part}_conv1d.weight") for part in "qkv"]
                tensor = None if any(p is None for p in parts) else torch.cat(parts)
            if tensor is not None:
                return tensor
        return None
