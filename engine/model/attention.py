"""Gated full attention of Qwen3.5 over the paged KV cache.

The q projection carries an output gate (per head: [query | gate]); q and k get a
zero-centred RMSNorm over the head dim, then partial rotary; K/V heads are shared by groups
of query heads. Attention is variable-length: the prefill chunk attends causally to its
sequence's cached prefix plus itself, each decode row to its own sequence's context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.kv_store import KVStore
from engine.kernels import custom_ops, paged_attention
from engine.model.batch import DecodeGroup, PackedBatch
from engine.model.config import ModelConfig
from engine.model.layers import FusedLinear, PartialRotary
from engine.model.norms import ZeroCenteredRMSNorm


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.fused_qkv: FusedLinear | None = None
        self.fused_o: FusedLinear | None = None

    def fuse(self) -> None:
        """One GEMM for q (with gate), k and v."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        bias = None
        if self.q_proj.bias is not None:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()
        self.fused_qkv = FusedLinear(weight, bias)
        self.fused_o = FusedLinear(self.o_proj.weight, self.o_proj.bias)

    def _project(self, x: torch.Tensor):
        q_size, kv_size = self.num_heads * self.head_dim * 2, self.num_kv_heads * self.head_dim
        if self.fused_qkv is not None:
            return self.fused_qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, batch: PackedBatch, kv: KVStore, rotary: PartialRotary,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; cos/sin: [T, rotary_dim]."""
        tokens = x.shape[0]
        q_gate, k, v = self._project(x)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = rotary.apply(self.q_norm(q), cos, sin)  # [T, H, D]
        q = kv.scale_query(self.layer_id, q)  # InnerQ's key normalization, folded into the query
        k = rotary.apply(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if batch.prefill is None and type(kv) is KVStore:
            # Decode rows only, full-precision store: the K/V write and the attention in one native call
            # (a custom op in the compiled decode step).
            keys, values, group = kv.keys[self.layer_id], kv.values[self.layer_id], batch.decode
            if torch.compiler.is_compiling():
                out = custom_ops.paged_decode_attention_traced(q, k, v, keys, values, batch.kv_slots,
                                                               group.block_tables, group.context_lens, gate)
            else:
                out = paged_attention.decode(q, keys, values, group.block_tables, group.context_lens, gate,
                                             new_kv=(k, v, batch.kv_slots))
            if out is not None:  # [B, H * D]
                return self.fused_o(out) if self.fused_o is not None else self.o_proj(out)
        kv.write(self.layer_id, batch.kv_slots, k, v)
        if batch.decode is None and getattr(batch, "ssm_row_states", None) is not None:
            out = self._verify_attention(q, gate, batch, kv)   # a speculative verify (engine/spec/verify.py)
            return self.fused_o(out) if self.fused_o is not None else self.o_proj(out)

        outputs = []  # gated [rows, H * D]: prefill rows, then decode rows
        split = batch.num_prefill_tokens
        if batch.prefill is not None:
            out = self._prefill_attention(q[:split], batch, kv) * torch.sigmoid(gate[:split])  # [L, H, D]
            outputs.append(out.reshape(split, self.num_heads * self.head_dim))
        if batch.decode is not None:
            outputs.append(self._gated_decode_attention(q[split:], gate[split:], batch, kv))
        out = torch.cat(outputs, dim=0) if len(outputs) > 1 else outputs[0]  # [T, H * D]
        return self.fused_o(out) if self.fused_o is not None else self.o_proj(out)

    def _gated_decode_attention(self, q: torch.Tensor, gate: torch.Tensor, batch: PackedBatch,
                                kv: KVStore) -> torch.Tensor:
        """Decode rows q, gate [B, H, D] -> attention output times sigmoid(gate), [B, H * D].

        A plain store is read in place by the native kernel (each row through its block table);
        a quantized store, or where the kernel does not run, gathers and runs SDPA.
        """
        group = batch.decode
        if type(kv) is KVStore:
            out = paged_attention.decode(q, kv.keys[self.layer_id], kv.values[self.layer_id], group.block_tables,
                                         group.context_lens, gate)
            if out is not None:
                return out
        out = self._decode_attention(q, group, kv) * torch.sigmoid(gate)  # [B, H, D]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _verify_attention(self, q: torch.Tensor, gate: torch.Tensor, batch: PackedBatch,
                          kv: KVStore) -> torch.Tensor:
        """A speculative verify's rows q, gate [L, H, D] -> [L, H * D], row i attending as the decode step at
        its position would (over positions 0 .. start + i), by the path decode takes: the native kernel on
        a plain store, else the gathered SDPA. SDPA over the segment rounds differently, and in bf16 that
        flipped near-tied tokens, so a speculative run's greedy tokens differed from a plain one's.
        """
        seg = batch.prefill
        tables = seg.block_ids[None].expand(seg.length, -1).contiguous()  # [L, W]: every row the sequence's blocks
        lens = torch.arange(seg.start + 1, seg.start + seg.length + 1, device=q.device)  # [L]
        if type(kv) is KVStore:
            out = paged_attention.decode(q, kv.keys[self.layer_id], kv.values[self.layer_id], tables, lens, gate)
            if out is not None:
                return out
        rows = DecodeGroup(ssm_slots=lens.new_zeros(seg.length), block_tables=tables, context_lens=lens)
        out = self._decode_attention(q, rows, kv) * torch.sigmoid(gate)  # [L, H, D]
        return out.reshape(seg.length, self.num_heads * self.head_dim)

    def _prefill_attention(self, q: torch.Tensor, batch: PackedBatch, kv: KVStore) -> torch.Tensor:
        seg = batch.prefill
        context = seg.start + seg.length
        keys, values = kv.gather(self.layer_id, seg.block_ids)  # [n * block, Hkv, D]
        keys, values = keys[:context].transpose(0, 1), values[:context].transpose(0, 1)  # [Hkv, S, D]
        # 4-D [1, H, L, D]: with 3-D inputs CPU SDPA drops to the unfused math path (full
        # softmax matrix, ~10x slower at 512 tokens); 4-D takes the flash kernel.
        query, keys, values = q.transpose(0, 1)[None], keys[None], values[None]
        if seg.start == 0:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            # Query i sits at position start + i and may see keys 0 .. start + i.
            rows = torch.arange(seg.length, device=q.device)[:, None] + seg.start
            mask = torch.arange(context, device=q.device)[None, :] <= rows  # [L, S]
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)  # [L, H, D]

    def _decode_attention(self, q: torch.Tensor, group: DecodeGroup, kv: KVStore) -> torch.Tensor:
        keys, values = kv.gather(self.layer_id, group.block_tables)  # [B, S, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, S, D]
        visible = group.visible  # [B, 1, 1, S]
        if visible is None:
            visible = (torch.arange(keys.shape[2], device=q.device)[None, :]
                       < group.context_lens[:, None])[:, None, None, :]
        query = q.unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, enable_gqa=True)
        return out.squeeze(2)  # [B, H, D]
