"""The Qwen3.5 multi-token-prediction (MTP) module, in the real checkpoint layout.

Weights (top level of the checkpoint, beside ``model.*``): ``mtp.fc.weight`` [H, 2H],
``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``,
``mtp.layers.N.*`` (a full-attention decoder layer named like the main model's layers) and
``mtp.norm.weight``. The embeddings and the LM head are the main model's (shared, not copied).

One MTP row at position p predicts the token at p + 2 from the token at p + 1 and the main
model's hidden state at p:

    x = fc(cat[pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)])   # [T, 2H] -> [T, H]
    g = norm(layer(x))                                                         # the MTP hidden
    logits = lm_head(g)

``h_p`` is the main model's hidden state AFTER its final norm, as vLLM's ``qwen3_5_mtp.py``
uses it (its target model returns the normed hidden states, which the MTP proposer takes).
Draft k > 1 feeds the MTP's own ``g`` as the hidden state of the next row and reuses the
layer (``layers[step % num_layers]``). The layer attends over its own paged K/V: the MTP
layer is one more full-attention layer of the KV store (id ``num_hidden_layers + i``) that
shares its sequence's block table, so its K/V is allocated, counted and freed with the
sequence's blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.cache.kv_store import KVStore
from engine.model.attention import GatedAttention
from engine.model.batch import PackedBatch
from engine.model.config import ModelConfig
from engine.model.layers import FusedLinear, PartialRotary, SwiGLU
from engine.model.norms import ZeroCenteredRMSNorm
from engine.model.qwen3_5 import DecoderLayer


class MTPDecoderLayer(DecoderLayer):
    """A full-attention decoder layer with the main layers' parameter names and forward.

    ``layer_id`` is its key in the KV store (past the main model's layers).
    """

    def __init__(self, config: ModelConfig, layer_id: int):
        nn.Module.__init__(self)
        self.is_linear = False
        self.self_attn = GatedAttention(config, layer_id)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()
        for norm in (self.input_layernorm, self.post_attention_layernorm,
                     self.self_attn.q_norm, self.self_attn.k_norm):
            norm.fuse()


class MTPModule(nn.Module):
    """``mtp.*``: fc, the two pre-fc norms, ``mtp_num_hidden_layers`` decoder layers, the final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(MTPDecoderLayer(config, config.num_hidden_layers + i)
                                    for i in range(config.mtp_num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(hidden, config.rms_norm_eps)
        self.fused_fc: FusedLinear | None = None

    @property
    def kv_layer_ids(self) -> list[int]:
        """The KV store keys of the MTP layers."""
        return [layer.self_attn.layer_id for layer in self.layers]

    def fuse(self) -> None:
        self.fused_fc = FusedLinear(self.fc.weight)
        for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm):
            norm.fuse()
        for layer in self.layers:
            layer.fuse()

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: PackedBatch, kv: KVStore,
                rotary: PartialRotary, step: int = 0) -> torch.Tensor:
        """embeds: embed(t_{p+1}) [T, H]; hidden: h_p [T, H]; ``batch`` places the rows at positions p.

        Writes the layer's K/V at the rows' slots and returns the MTP hidden states [T, H]
        (after ``mtp.norm``; the caller applies the shared LM head to the rows it wants).
        """
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)  # [T, 2H]
        x = self.fused_fc(x) if self.fused_fc is not None else self.fc(x)  # [T, H]
        cos, sin = rotary.cos_sin(batch.positions, x.dtype)
        layer = self.layers[step % len(self.layers)]
        x = layer(x, batch, kv, None, rotary, cos, sin)
        return self.norm(x)


def attach_mtp(model: nn.Module) -> MTPModule:
    """Give ``model`` (a Qwen35ForCausalLM) its MTP module, sized by its config."""
    config = model.config
    if config.mtp_num_hidden_layers < 1:
        raise ValueError("the config has mtp_num_hidden_layers = 0: there is no MTP module to attach")
    model.mtp = MTPModule(config).to(device=model.lm_head.weight.device, dtype=model.lm_head.weight.dtype)
    return model.mtp


@torch.inference_mode()
def mtp_forward(model: nn.Module, token_ids: torch.Tensor, hidden: torch.Tensor, batch: PackedBatch,
                kv: KVStore, *, step: int = 0, logits_rows: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MTP rows of ``batch`` (tokens t_{p+1} [T], main hidden h_p [T, H]) with the shared embeddings.

    Returns (MTP hidden [T, H], logits [R, V] at ``logits_rows`` or None when no rows are asked).
    """
    g = model.mtp(model.model.embed_tokens(token_ids), hidden, batch, kv, model.rotary, step)
    if logits_rows is None or logits_rows.numel() == 0:
        return g, None
    return g, model.lm_head(g.index_select(0, logits_rows)).float()
