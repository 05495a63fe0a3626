"""Gated DeltaNet: the linear-attention layer of Qwen3.5, over per-sequence states in the SSM pool.

The recurrence itself (chunked prefill form, one-token decode step) is in gdn_rule.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.ssm_pool import SSMPool
from engine.kernels import custom_ops, gdn_step, native
from engine.model.batch import PackedBatch
from engine.model.config import ModelConfig
from engine.model.gdn_rule import CHUNK_SIZE, chunked_gated_delta_rule, recurrent_gated_delta_step
from engine.model.layers import FusedLinear
from engine.model.norms import GatedRMSNorm

__all__ = ["CHUNK_SIZE", "GatedDeltaNet", "SSMCapture", "SSMRowStates", "chunked_gated_delta_rule",
           "recurrent_gated_delta_step"]


@dataclass
class SSMCapture:
    """Asks one forward's GDN layers for the prefill sequence's state after its first ``num_rows`` chunk rows.

    The runner hangs it on the batch (``batch.ssm_capture``); each linear layer fills its
    entry: conv ``[conv_dim, K-1]`` and recurrent ``[Hv, Dk, Dv]``, keyed by linear index.
    It lets a prefix-cache snapshot land inside a chunk without cutting the chunk there.
    """

    num_rows: int
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class SSMRowStates:
    """Asks a speculative verify's GDN layers for the prefill sequence's state after EVERY row.

    Hung on the batch as ``batch.ssm_row_states``. Each linear layer runs the segment with the
    one-token decode step (the rows are few: 1 + drafts) and fills conv ``[R, conv_dim, K-1]``
    and recurrent ``[R, Hv, Dk, Dv]`` under its linear index: row r holds the state after rows
    0..r, so a partial acceptance keeps the state of its last accepted row without re-feeding
    anything (one state per draft position, like vLLM's speculative state slots).
    """

    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, linear_index: int):
        super().__init__()
        self.linear_index = linear_index  # which slice of the SSM pool holds this layer's state
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.conv_dim, self.conv_kernel = config.conv_dim, config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim,
                                bias=False, padding=self.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.fused_in: FusedLinear | None = None
        self.fused_out: FusedLinear | None = None
        self.decay_rate: tuple[torch.Tensor, torch.Tensor] | None = None  # (-exp(A_log), dt_bias), fuse()
        self.conv_weight: torch.Tensor | None = None  # [conv_dim, K] view of the conv weight, fuse()
        # bf16 layers: float32 copies of the conv and norm weights for the native (float32) decode step, fuse()
        self.native_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        # The prefill recurrence; training swaps in the autograd form (engine/train/delta_rule.py).
        self.prefill_rule = chunked_gated_delta_rule

    def fuse(self) -> None:
        """One GEMM for the four input projections (qkv, z, b, a)."""
        self.fused_in = FusedLinear(torch.cat([self.in_proj_qkv.weight, self.in_proj_z.weight,
                                               self.in_proj_b.weight, self.in_proj_a.weight], dim=0))
        self.fused_out = FusedLinear(self.out_proj.weight)
        # The decay constants in float32, so the hot path does not recompute exp(A_log) per forward.
        self.decay_rate = (-self.A_log.detach().float().exp(), self.dt_bias.detach().float())
        # A view (same storage): the per-forward slice + select of the parameter cost two dispatches.
        self.conv_weight = self.conv1d.weight.detach()[:, 0, :]
        if self.conv_weight.dtype == torch.bfloat16:
            self.native_weights = (self.conv_weight.float().contiguous(), self.norm.weight.detach().float())

    def _project(self, x: torch.Tensor):
        sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        if self.fused_in is not None:
            return self.fused_in(x).split(sizes, dim=-1)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, batch: PackedBatch, pool: SSMPool) -> torch.Tensor:
        """x: [T, hidden] packed rows (prefill chunk first, then decode rows)."""
        mixed, z, b, a = self._project(x)  # [T, conv_dim], [T, value_dim], [T, Hv], [T, Hv]
        conv_states = pool.conv[self.linear_index]  # [S, conv_dim, K-1]
        rec_states = pool.recurrent[self.linear_index]  # [S, Hv, Dk, Dv]
        weight = self.conv_weight if self.conv_weight is not None else self.conv1d.weight[:, 0, :]  # [conv_dim, K]
        neg_rate, dt_bias = self.decay_rate or (-self.A_log.float().exp(), self.dt_bias.float())
        pieces = []  # [rows, value_dim] normed outputs: prefill rows, then decode rows

        split = batch.num_prefill_tokens
        if batch.prefill is not None:
            slot = batch.prefill.ssm_slot
            g, beta = self._gates(a[:split], b[:split], neg_rate, dt_bias)  # [L, Hv] each
            window = torch.cat([conv_states[slot].to(mixed.dtype), mixed[:split].t()], dim=-1)  # [C, K-1+L]
            conv_states[slot] = window[:, -(self.conv_kernel - 1):].float()
            conv_out = F.silu(F.conv1d(window[None], weight[:, None, :], groups=self.conv_dim)[0]).t()  # [L, C]
            # Head-major for the chunked rule; q and k stay at the key heads (the rule groups them).
            q, k, v = (x.transpose(0, 1) for x in self._split_heads(conv_out))  # [H, L, D]
            g_heads, beta_heads = g.t(), beta.t()  # [Hv, L]
            capture = getattr(batch, "ssm_capture", None)
            row_states = getattr(batch, "ssm_row_states", None)
            if row_states is not None:  # normed as the decode step norms its rows: the same arithmetic
                normed, final = self._prefill_every_row(window, mixed[:split], z[:split], b[:split], a[:split],
                                                        neg_rate, dt_bias, rec_states[slot], row_states)
            else:
                if capture is None:
                    out, final = self.prefill_rule(q, k, v, g_heads, beta_heads, rec_states[slot])
                else:
                    out, final = self._prefill_with_capture(window, q, k, v, g_heads, beta_heads,
                                                            rec_states[slot], capture)
                normed = self._norm(out.transpose(0, 1), z[:split], x.dtype)  # from [L, Hv, Dv]
            rec_states[slot] = final
            pieces.append(normed)

        if batch.decode is not None:
            group = batch.decode
            if split:  # the decode rows follow the chunk's
                mixed, z, b, a = mixed[split:], z[split:], b[split:], a[split:]
            rows = mixed  # [B, C]
            # A compiled graph calls the native step as a custom op on the whole pools (None where it
            # does not apply: then the tensor step, traced).
            normed = None
            if torch.compiler.is_compiling():
                wide_rows, wide_z, wide_b, wide_a, conv_weight, norm_weight = self._native_inputs(rows, z, b, a,
                                                                                                  weight)
                normed = custom_ops.gdn_decode_gated_traced(
                    wide_rows, pool.conv, pool.recurrent, self.linear_index, conv_weight, group.ssm_slots, wide_a,
                    wide_b, neg_rate, dt_bias, wide_z, norm_weight, self.norm.eps, self.num_k_heads, self.head_k_dim,
                    self.head_v_dim)
            if normed is not None:
                normed = normed.to(rows.dtype)  # one rounding of the float32 step's output (none for float32)
            else:
                normed = self._decode_normed(rows, z, b, a, neg_rate, dt_bias, weight, conv_states, rec_states,
                                             group.ssm_slots, group.slot_range, pool)
            pieces.append(normed)  # [B, value_dim]

        core = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]  # [T, value_dim]
        return self.fused_out(core) if self.fused_out is not None else self.out_proj(core)

    def _decode_normed(self, rows, z, b, a, neg_rate, dt_bias, weight, conv_states, rec_states, slots, slot_range,
                       pool: SSMPool | None = None) -> torch.Tensor:
        """One token per row through the decode step, gated and normed: -> [B, value_dim] in rows' dtype.

        The native step computes the gates and the output norm itself in float32 (a bf16 layer's rows
        widened for it, its output rounded once); else the native recurrence or the tensor step, then the
        torch norm. A speculative verify's rows (``_prefill_every_row``) come here too, so a token verified
        and the same token decoded get the same numbers (bf16 decode on the widened step drifted from bf16
        verify rows on the tensor step before: served tokens then depended on when speculation ran).
        """
        wide_rows, wide_z, wide_b, wide_a, conv_weight, norm_weight = self._native_inputs(rows, z, b, a, weight)
        normed = gdn_step.decode_gated(wide_rows, conv_states, conv_weight, rec_states, slots, wide_a, wide_b,
                                       neg_rate, dt_bias, wide_z, norm_weight, self.norm.eps, self.num_k_heads,
                                       self.head_k_dim, self.head_v_dim)
        if normed is not None:
            return normed.to(rows.dtype)  # one rounding of the float32 step's output (none for float32)
        g_rows, beta_rows = self._gates(a, b, neg_rate, dt_bias)  # [B, Hv] each
        out = gdn_step.decode(rows, conv_states, weight, rec_states, slots, g_rows, beta_rows, self.num_k_heads,
                              self.head_k_dim, self.head_v_dim)
        if out is None:
            out = self._decode_rows(rows, g_rows, beta_rows, conv_states, rec_states, slots, slot_range, pool)
        return self._norm(out, z, rows.dtype)

    def _native_inputs(self, rows, z, b, a, weight):
        """The fused native decode step's inputs: (rows, z, b, a, conv weight, norm weight).

        It computes in float32 on the float32 pools: a bf16 layer's projections are widened for it
        and the caller rounds its output back to bf16 once (5 conversions, against ~25 torch ops of
        the tensor path, which rounds the conv and the norm to bf16 on the way: the native step is
        the more precise). Other dtypes pass as they are (the step declines what it does not take).
        """
        if rows.dtype == torch.bfloat16 and self.native_weights is not None and native.enabled():
            return (rows.float(), z.float(), b.float(), a.float(), *self.native_weights)
        return rows, z, b, a, weight, self.norm.weight

    @staticmethod
    def _gates(a: torch.Tensor, b: torch.Tensor, neg_rate: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw gate projections a, b [R, Hv] -> (g log decay, beta), [R, Hv] float32 each."""
        return neg_rate * F.softplus(a.float() + dt_bias), b.float().sigmoid()

    def _norm(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gated output norm of recurrence outputs [R, Hv, Dv] with gate z [R, value_dim] -> [R, value_dim]."""
        rows = out.shape[0]
        normed = self.norm(out.to(dtype), z.view(rows, self.num_v_heads, self.head_v_dim))
        return normed.reshape(rows, self.value_dim)

    def _prefill_every_row(self, window: torch.Tensor, rows: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                           a: torch.Tensor, neg_rate: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                           row_states: SSMRowStates) -> tuple[torch.Tensor, torch.Tensor]:
        """The segment one row at a time through the decode step itself, keeping every row's state.

        window: [conv_dim, K-1+R] (old conv state, then the rows' inputs); rows: [R, conv_dim];
        z: [R, value_dim]; b, a: [R, Hv] raw gate projections; state: [Hv, Dk, Dv]. Returns (normed
        outputs [R, value_dim], final state). Each row runs ``_decode_normed``, the code a plain decode
        step runs, so the kept states and the outputs equal what R decode steps would give.
        """
        num_rows = rows.shape[0]
        weight = self.conv_weight if self.conv_weight is not None else self.conv1d.weight[:, 0, :]  # [C, K]
        conv_pool = state.new_empty(1, self.conv_dim, self.conv_kernel - 1)  # [1, C, K-1]: a one-slot pool
        conv_pool[0] = window[:, :self.conv_kernel - 1]
        rec_pool = state.clone()[None]  # [1, Hv, Dk, Dv]
        slot = torch.zeros(1, dtype=torch.long, device=state.device)
        kept_conv = conv_pool.new_empty(num_rows, *conv_pool.shape[1:])  # [R, C, K-1]
        kept = rec_pool.new_empty(num_rows, *rec_pool.shape[1:])  # [R, Hv, Dk, Dv]
        outputs = []
        for r in range(num_rows):
            one = slice(r, r + 1)
            outputs.append(self._decode_normed(rows[one], z[one], b[one], a[one], neg_rate, dt_bias, weight,
                                               conv_pool, rec_pool, slot, (0, 1)))  # [1, value_dim]
            kept_conv[r], kept[r] = conv_pool[0], rec_pool[0]
        row_states.conv[self.linear_index] = kept_conv
        row_states.recurrent[self.linear_index] = kept
        return torch.cat(outputs), rec_pool[0]

    def _prefill_with_capture(self, window: torch.Tensor, q, k, v, g, beta, state: torch.Tensor,
                              capture: SSMCapture) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill recurrence in two parts, [0, r) and [r, L), recording the state between them.

        window: [conv_dim, K-1+L] (old conv state, then the chunk's inputs); q, k: [Hk, L, Dk];
        v: [Hv, L, Dv]; g, beta: [Hv, L]; state: [Hv, Dk, Dv]. Returns (outputs [Hv, L, Dv], final state).
        """
        rows = capture.num_rows
        # After r tokens the conv window holds the last K-1 inputs: columns r .. r+K-2.
        capture.conv[self.linear_index] = window[:, rows:rows + self.conv_kernel - 1].float().clone()
        parts = [(x[:, :rows], x[:, rows:]) for x in (q, k, v, g, beta)]
        (q0, q1), (k0, k1), (v0, v1), (g0, g1), (b0, b1) = parts
        head_out, middle = chunked_gated_delta_rule(q0, k0, v0, g0, b0, state)
        tail_out, final = chunked_gated_delta_rule(q1, k1, v1, g1, b1, middle)
        capture.recurrent[self.linear_index] = middle.clone()
        return torch.cat([head_out, tail_out], dim=1), final

    def _decode_rows(self, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_states: torch.Tensor,
                     rec_states: torch.Tensor, slots: torch.Tensor, slot_range: tuple[int, int] | None,
                     pool: SSMPool | None = None) -> torch.Tensor:
        """The decode step in tensor ops (where the native kernel does not run): -> [B, Hv, Dv].

        rows [B, conv_dim] pre-conv inputs; g, beta [B, Hv]; conv_states [S, C, K-1] and
        rec_states [S, Hv, Dk, Dv] the pools, updated in place at ``slots`` [B]: on views when
        the slots are consecutive (``slot_range`` (first, end)), else on gathered copies
        scattered back (through ``pool.write_rows`` when given: a compiled graph writes the pool itself).
        """
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        if slot_range is not None:
            conv_view = conv_states[slot_range[0]:slot_range[1]]  # [B, C, K-1]
            state = rec_states[slot_range[0]:slot_range[1]]  # [B, Hv, Dk, Dv]
        else:
            conv_view, state = conv_states.index_select(0, slots), rec_states.index_select(0, slots)
        window = torch.cat([conv_view.to(rows.dtype), rows[:, :, None]], dim=-1)  # [B, C, K]
        conv_view.copy_(window[:, :, 1:])
        conv_out = F.silu((window * weight).sum(-1))  # [B, C]
        q, k, v = self._split_heads(conv_out)
        repeat = self.num_v_heads // self.num_k_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)  # [B, Hv, Dk]
        out = recurrent_gated_delta_step(q, k, v, g, beta, state)
        if slot_range is None and pool is not None:
            pool.write_rows(self.linear_index, slots, conv_view, state)  # the base tensors while compiling
        elif slot_range is None:
            conv_states.index_copy_(0, slots, conv_view)
            rec_states.index_copy_(0, slots, state)
        return out

    def _split_heads(self, conv_out: torch.Tensor):
        """[T, conv_dim] -> l2-normalised, scaled q, k [T, Hk, Dk] and v [T, Hv, Dv], in float32.

        q and k stay at the key heads: the chunked rule groups them, the tensor decode step
        repeats them (``_decode_rows``).
        """
        tokens = conv_out.shape[0]
        q, k, v = conv_out.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.view(tokens, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = _l2norm(k.view(tokens, self.num_k_heads, self.head_k_dim))
        return q, k, v.view(tokens, self.num_v_heads, self.head_v_dim)
