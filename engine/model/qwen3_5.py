"""The Qwen3.5 hybrid decoder (text part), with HF parameter names so checkpoints load as they are."""
from __future__ import annotations

import torch
from torch import nn

from engine.cache.kv_store import KVStore
from engine.cache.ssm_pool import SSMPool
from engine.model.attention import GatedAttention
from engine.model.batch import PackedBatch
from engine.model.config import ModelConfig
from engine.model.gdn import GatedDeltaNet
from engine.model.layers import FusedLinear, PartialRotary, SwiGLU
from engine.model.norms import ZeroCenteredRMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, linear_index: int | None, make_mlp=None):
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, linear_index)
        else:
            self.self_attn = GatedAttention(config, layer_id)
        # ``make_mlp(config, layer_id)``: another feed-forward block (the MoE model's sparse block).
        self.mlp = make_mlp(config, layer_id) if make_mlp else SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, batch, kv, pool, rotary, cos, sin, keep_rows: torch.Tensor | None = None):
        """x: [T, hidden] -> [T, hidden], or [R, hidden] for the rows in ``keep_rows``.

        The mixer always runs on every row (each one writes its K/V or advances the SSM state);
        ``keep_rows`` only drops the others before the residual add and the MLP, which the last
        layer needs for the logits rows alone.
        """
        mixed = self.mix(self.input_layernorm(x), batch, kv, pool, rotary, cos, sin)
        if keep_rows is not None:
            x, mixed = x.index_select(0, keep_rows), mixed.index_select(0, keep_rows)  # [R, hidden]
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x))

    def mix(self, normed, batch, kv, pool, rotary, cos, sin) -> torch.Tensor:
        """The token mixer over normed rows [T, hidden]: its K/V or SSM state goes to the caches."""
        if self.is_linear:
            return self.linear_attn(normed, batch, pool)
        return self.self_attn(normed, batch, kv, rotary, cos, sin)

    def fuse(self) -> None:
        (self.linear_attn if self.is_linear else self.self_attn).fuse()
        self.mlp.fuse()
        self.input_layernorm.fuse()
        self.post_attention_layernorm.fuse()
        if not self.is_linear:
            self.self_attn.q_norm.fuse()
            self.self_attn.k_norm.fuse()


class TextModel(nn.Module):
    """Embeddings, the decoder layers (``layer_class``) and the final norm (``norm_class``)."""

    def __init__(self, config: ModelConfig, make_mlp=None, layer_class=DecoderLayer,
                 norm_class=ZeroCenteredRMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        linear_index = {layer: i for i, layer in enumerate(config.linear_attention_layers)}
        self.layers = nn.ModuleList(layer_class(config, i, linear_index.get(i), make_mlp)
                                    for i in range(config.num_hidden_layers))
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    """Forward over a packed :class:`PackedBatch`; K/V go to the paged store, GDN state to the pool."""

    is_mla = False  # plain grouped K/V heads, no latent compression
    is_ep = False  # dense MLP, no expert parallelism
    # Decode-only forwards may run compiled (engine/model/compiled_decode.py): every op's shape
    # follows the padded batch and the block-table width, none depends on tensor values.
    supports_compiled_decode = True
    layer_class = DecoderLayer  # what TextModel builds each layer with (Kimi Linear: its own)
    norm_class = ZeroCenteredRMSNorm

    def __init__(self, config: ModelConfig, make_mlp=None):
        super().__init__()
        self.config = config
        self.model = TextModel(config, make_mlp, self.layer_class, self.norm_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = self.make_rotary(config)
        self.fused_lm_head: FusedLinear | None = None  # prepacked LM head, set by fuse()
        # Special token ids, filled by the loader from the tokenizer when it has them.
        self.eos_token_id: int | None = config.eos_token_id
        self.think_start_id: int | None = None
        self.think_end_id: int | None = None
        self.tool_call_start_id: int | None = None
        self.tool_call_end_id: int | None = None
        self.code_fence_id: int | None = None
        # The MTP module (engine/model/mtp.py), attached by the loader when the checkpoint has one.
        self.mtp: nn.Module | None = None
        self.mtp_absent_reason = "no MTP module attached"
        # The vision tower and its config (engine/model/vision.py), attached by the loader when
        # config.json has a vision_config.
        self.visual: nn.Module | None = None
        self.vision_config = None

    @staticmethod
    def make_rotary(config: ModelConfig):
        return PartialRotary(config.rotary_dim, config.rope_theta)

    @property
    def has_mtp_head(self) -> bool:
        return self.mtp is not None

    @property
    def has_self_draft(self) -> bool:
        """Self-speculation drafts with the first layers; it needs at least one layer left to skip."""
        return self.config.num_hidden_layers >= 2

    @property
    def kv_layer_ids(self) -> list[int]:
        """Every layer with paged K/V: the full-attention layers, then the MTP layers."""
        return self.config.full_attention_layers + (self.mtp.kv_layer_ids if self.mtp is not None else [])

    def prefill_tail_split(self, prompt_tokens: int) -> int | None:
        """Where to cut a prompt so its SSM tail state can be checkpointed separately.

        None for Qwen3.5: its Gated DeltaNet state after any prefix is exactly what the
        chunked rule leaves in the pool at that chunk boundary, and the scheduler's block-
        aligned chunk cuts already give the snapshot points, so no model-specific split exists.
        """
        return None

    def fuse(self) -> None:
        """Concatenate projection weights for fewer, larger GEMMs (call after loading weights)."""
        for layer in self.model.layers:
            layer.fuse()
        self.model.norm.fuse()
        if self.mtp is not None:
            self.mtp.fuse()
        # The LM head is the largest single GEMM (vocab x hidden) and runs at decode width.
        self.fused_lm_head = FusedLinear(self.lm_head.weight)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, kv: KVStore, pool: SSMPool,
                logits_rows: torch.Tensor | None = None, *, return_hidden: bool = False,
                exit_after: int | None = None):
        """Returns logits [R, V] for the rows in ``logits_rows`` (all rows when None).

        ``return_hidden``: return (logits, hidden [T, H]) with the hidden state of every row after
        the final norm (what the MTP module reads). ``exit_after=L``: run only the first L layers,
        then the final norm and the LM head (the self-speculative early-exit draft).
        """
        x = self.model.embed_tokens(batch.token_ids)  # [T, hidden]
        if batch.image_rows is not None:
            x = x.index_copy(0, batch.image_rows, batch.image_embeds.to(x.dtype))  # placeholders -> the tower's rows
        rope = batch.rope_positions if batch.rope_positions is not None else batch.positions
        cos, sin = self.rotary.cos_sin(rope, x.dtype)
        layers = self.model.layers if exit_after is None else self.model.layers[:exit_after]
        *body, last = layers
        for layer in body:
            x = layer(x, batch, kv, pool, self.rotary, cos, sin)
        if return_hidden:
            hidden = self.model.norm(last(x, batch, kv, pool, self.rotary, cos, sin))  # [T, hidden]
            rows = hidden if logits_rows is None else hidden.index_select(0, logits_rows)
            head = self.fused_lm_head if self.fused_lm_head is not None else self.lm_head
            return head(rows).float(), hidden
        # Rows without logits stop after the last mixer: their MLP output would feed nothing.
        x = last(x, batch, kv, pool, self.rotary, cos, sin, keep_rows=logits_rows)  # [R, hidden]
        head = self.fused_lm_head if self.fused_lm_head is not None else self.lm_head
        return head(self.model.norm(x)).float()
