"""Multi-head latent attention (MLA) as Kimi Linear uses it, over the paged latent cache.

Per token a layer caches one row: ``c = RMSNorm(x W_DKV)`` (kv_lora_rank values) and the key
part ``k_r`` all heads share (qk_rope_head_dim values; Kimi applies no rotary to it: the KDA
layers carry position). Head h's key is [W_UK_h c | k_r] and its value W_UV_h c, where
``kv_b_proj`` stacks W_UK and W_UV. Queries come from ``q_proj`` (or the ``q_a``/``q_b`` low-rank
pair). The score scale is (qk_nope_head_dim + qk_rope_head_dim)^-0.5.

Two forms of the same attention:

* prefill (expanded): up-project the chunk's latents, and its cached context's in bounded
  sub-chunks (mla_prefill.py), to per-head K/V and attend; compute-bound rows want the
  smaller head dims.
* decode (absorbed, the fast path): q_h . [W_UK_h c | k_r] = [W_UK_h^T q_nope_h | q_rope_h] . [c | k_r],
  so each head's query is folded into the latent space and all heads read the same cached rows,
  one [H, r + rope] x [r + rope, S] product per sequence, no per-step up-projection of the context;
  the output folds W_UV after the softmax: sum_t p_t W_UV c_t = W_UV (sum_t p_t c_t).
  bench/mla.py measures it against the expanded form.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.latent_store import LatentKVStore
from engine.model.batch import PackedBatch
from engine.model.layers import FusedLinear
from engine.model.norms import RMSNorm
from engine.model.mla_prefill import CONTEXT_SUB_CHUNK, chunk_over_context

LATENT_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm / q_a_layernorm with the RMSNorm default eps


class LatentAttention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank, self.qk_dim = config.kv_lora_rank, config.qk_head_dim
        self.scale = self.qk_dim ** -0.5
        self.context_sub_chunk = CONTEXT_SUB_CHUNK
        hidden, bias, q_width = config.hidden_size, config.attention_bias, self.num_heads * self.qk_dim
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.fused_in: FusedLinear | None = None
        self.fused_kv_b: FusedLinear | None = None
        self.fused_q_b: FusedLinear | None = None
        self.fused_o: FusedLinear | None = None
        self.absorb: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_UK [H, nope, r], W_UV^T [H, r, v])

    def fuse(self) -> None:
        """One GEMM for the query (or its low-rank down-projection) and the latent projection."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        weight = torch.cat([first.weight, self.kv_a_proj_with_mqa.weight]).detach()
        bias = None
        if self.kv_a_proj_with_mqa.bias is not None:
            first_bias = first.bias if first.bias is not None else first.weight.new_zeros(first.weight.shape[0])
            bias = torch.cat([first_bias, self.kv_a_proj_with_mqa.bias]).detach()
        self.fused_in = FusedLinear(weight, bias)
        self.fused_kv_b = FusedLinear(self.kv_b_proj.weight)
        if self.q_lora_rank is not None:
            self.fused_q_b = FusedLinear(self.q_b_proj.weight)
            self.q_a_layernorm.fuse()
        self.fused_o = FusedLinear(self.o_proj.weight, self.o_proj.bias)
        self.kv_a_layernorm.fuse()
        up = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.absorb = (up[:, :self.nope_dim].contiguous(), up[:, self.nope_dim:].transpose(1, 2).contiguous())

    # ---- projections ---------------------------------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> queries [T, H, qk_dim] and latent rows [T, r + rope] (what the cache keeps)."""
        tokens = x.shape[0]
        first_width = self.num_heads * self.qk_dim if self.q_lora_rank is None else self.q_lora_rank
        if self.fused_in is not None:
            q, latent = self.fused_in(x).split([first_width, self.rank + self.rope_dim], dim=-1)
        else:
            q = self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x)
            latent = self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_a_layernorm(q)
            q = self.fused_q_b(q) if self.fused_q_b is not None else self.q_b_proj(q)
        c, k_rope = latent.split([self.rank, self.rope_dim], dim=-1)
        return q.view(tokens, self.num_heads, self.qk_dim), torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [S, r + rope] -> head-major K [H, S, qk_dim] and V [H, S, v_dim]."""
        rows = latent.shape[0]
        c, k_rope = latent.split([self.rank, self.rope_dim], dim=-1)
        up = self.fused_kv_b(c) if self.fused_kv_b is not None else self.kv_b_proj(c)
        k_nope, v = up.view(rows, self.num_heads, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(rows, self.num_heads, self.rope_dim)], dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: PackedBatch, kv: LatentKVStore, rotary=None, cos=None,
                sin=None) -> torch.Tensor:
        """x: [T, hidden] packed rows (prefill chunk first, then decode rows) -> [T, hidden].

        ``rotary`` / ``cos`` / ``sin`` are the decoder's shared arguments; Kimi's MLA uses none.
        """
        q, latent = self._project(x)
        kv.write(self.layer_id, batch.kv_slots, latent)
        split = batch.num_prefill_tokens
        outputs = []  # [rows, H * v_dim]: prefill rows, then decode rows
        if batch.prefill is not None:
            outputs.append(self.prefill_attention(q[:split], latent[:split], batch, kv))
        if batch.decode is not None:
            outputs.append(self.absorbed_decode(q[split:], batch, kv))
        out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return self.fused_o(out) if self.fused_o is not None else self.o_proj(out)

    def prefill_attention(self, q: torch.Tensor, latent: torch.Tensor, batch: PackedBatch,
                          kv: LatentKVStore) -> torch.Tensor:
        """The chunk's queries q [L, H, qk_dim] over its cached context and itself -> [L, H * v_dim]."""
        seg = batch.prefill
        length = q.shape[0]
        k, v = self.expand(latent)  # [H, L, *]
        query = q.transpose(0, 1)  # [H, L, qk_dim]
        if seg.start == 0:
            # No cached context: one causal SDPA (4-D, the flash kernel's layout).
            out = F.scaled_dot_product_attention(query[None], k[None], v[None], is_causal=True, scale=self.scale)[0]
        else:
            def read_context(first: int, end: int):
                return self.expand(kv.gather_tokens(self.layer_id, seg.block_ids, first, end))

            out = chunk_over_context(query, k, v, seg.start, read_context, self.scale,
                                     self.context_sub_chunk).to(q.dtype)
        return out.transpose(0, 1).reshape(length, self.num_heads * self.v_dim)

    def absorbed_decode(self, q: torch.Tensor, batch: PackedBatch, kv: LatentKVStore) -> torch.Tensor:
        """Decode rows q [B, H, qk_dim] over their sequences' cached latents, in the latent space -> [B, H * v_dim]."""
        group, rows = batch.decode, q.shape[0]
        w_uk, w_uv_t = self.absorb if self.absorb is not None else self._absorb_weights()
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, r]
        q_abs = torch.cat([q_latent, q_rope], dim=-1)  # [B, H, r + rope]
        latents = kv.gather(self.layer_id, group.block_tables)  # [B, S, r + rope]
        scores = torch.bmm(q_abs, latents.transpose(1, 2)).float().mul_(self.scale)  # [B, H, S]
        visible = group.visible
        visible = (visible.view(rows, 1, -1) if visible is not None else
                   (torch.arange(latents.shape[1], device=q.device)[None, :] < group.context_lens[:, None])[:, None])
        probs = scores.masked_fill_(~visible, float("-inf")).softmax(-1).to(q.dtype)
        out_latent = torch.bmm(probs, latents[..., :self.rank])  # [B, H, r]
        out = torch.bmm(out_latent.transpose(0, 1), w_uv_t)  # [H, B, v]
        return out.transpose(0, 1).reshape(rows, self.num_heads * self.v_dim)

    def expanded_decode(self, q: torch.Tensor, batch: PackedBatch, kv: LatentKVStore) -> torch.Tensor:
        """The same rows by up-projecting every context latent each step (bench/mla.py's baseline)."""
        group, outs = batch.decode, []
        latents = kv.gather(self.layer_id, group.block_tables)  # [B, S, r + rope]
        for row in range(q.shape[0]):
            k, v = self.expand(latents[row, :int(group.context_lens[row])])  # [H, S_row, *]
            out = F.scaled_dot_product_attention(q[row][:, None][None], k[None], v[None], scale=self.scale)
            outs.append(out[0, :, 0].reshape(-1))  # [H * v]
        return torch.stack(outs)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        up = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return up[:, :self.nope_dim], up[:, self.nope_dim:].transpose(1, 2)
