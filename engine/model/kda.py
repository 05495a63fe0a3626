"""Kimi Delta Attention (KDA): Kimi Linear's linear-attention layer, over per-sequence states in the SSM pool.

Like Gated DeltaNet (gdn.py): q, k, v through one short causal convolution with SiLU, q and k
l2-normalised (q also scaled by Dk^-0.5), a delta rule with beta = sigmoid(b_proj x). It differs
in the forget gate, one log-decay per key channel from a low-rank projection
(``-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``), and in the output norm, an RMSNorm gated by
``sigmoid(g_b(g_a(x)))``. q, k and v share one head count and head dim, so the pool's slots have
the GDN shapes with Hk = Hv and Dk = Dv; snapshots, restores and the prefix cache's state copies
work on them unchanged. The recurrence is in kda_rule.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.ssm_pool import SSMPool
from engine.model.batch import PackedBatch
from engine.model.gdn import SSMCapture, SSMRowStates
from engine.model.kda_rule import chunked_kda_rule, recurrent_kda_step
from engine.model.layers import FusedLinear

L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps), the reference's form (sqrt and divide, not rsqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


class ForgetGate(nn.Module):
    """Per-channel log-decays; HF names (``forget_gate.f_a_proj`` ...); A_log keeps its [1, 1, H, 1] shape."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))

    def log_decay(self, low_rank: torch.Tensor, up: FusedLinear | None) -> torch.Tensor:
        """f_a(x) [T, Dk] -> g [T, H, Dk] float32 (<= 0)."""
        raw = up(low_rank) if up is not None else self.f_b_proj(low_rank)
        gate = (raw.float() + self.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        return -self.A_log.float().view(1, self.num_heads, 1).exp() * F.softplus(gate)


class SigmoidGatedRMSNorm(nn.Module):
    """``weight * x / rms(x) * sigmoid(gate)``, all in float32 (the reference norms strictly in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config, linear_index: int):
        super().__init__()
        self.linear_index = linear_index  # which slice of the SSM pool holds this layer's state
        self.num_heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        self.width = self.num_heads * self.head_dim
        self.conv_dim, self.conv_kernel = config.conv_dim, config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.width, bias=False)
        self.k_proj = nn.Linear(hidden, self.width, bias=False)
        self.v_proj = nn.Linear(hidden, self.width, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=self.conv_kernel - 1)
        self.forget_gate = ForgetGate(hidden, self.num_heads, self.head_dim)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, self.width, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(self.width, hidden, bias=False)
        self.fused_in: FusedLinear | None = None
        self.fused_f_b: FusedLinear | None = None
        self.fused_g_b: FusedLinear | None = None
        self.fused_out: FusedLinear | None = None

    def fuse(self) -> None:
        """One GEMM for the six projections of x (q, k, v, f_a, b, g_a)."""
        self.fused_in = FusedLinear(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                               self.forget_gate.f_a_proj.weight, self.b_proj.weight,
                                               self.g_a_proj.weight]).detach())
        self.fused_f_b = FusedLinear(self.forget_gate.f_b_proj.weight)
        self.fused_g_b = FusedLinear(self.g_b_proj.weight)
        self.fused_out = FusedLinear(self.o_proj.weight)

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> mixed qkv [T, conv_dim], g [T, H, Dk], beta [T, H], output gate [T, H, Dk]."""
        sizes = [self.conv_dim, self.head_dim, self.num_heads, self.head_dim]
        if self.fused_in is not None:
            mixed, f_a, b, g_a = self.fused_in(x).split(sizes, dim=-1)
        else:
            mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            f_a, b, g_a = self.forget_gate.f_a_proj(x), self.b_proj(x), self.g_a_proj(x)
        g = self.forget_gate.log_decay(f_a, self.fused_f_b)
        gate = self.fused_g_b(g_a) if self.fused_g_b is not None else self.g_b_proj(g_a)
        return mixed, g, b.float().sigmoid(), gate.view(-1, self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, batch: PackedBatch, pool: SSMPool) -> torch.Tensor:
        """x: [T, hidden] packed rows (prefill chunk first, then decode rows)."""
        mixed, g, beta, gate = self._project(x)
        conv_states = pool.conv[self.linear_index]  # [S, conv_dim, K-1]
        rec_states = pool.recurrent[self.linear_index]  # [S, H, Dk, Dv]
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, K]
        pieces = []  # [rows, H, Dv] recurrence outputs: prefill rows, then decode rows
        split = batch.num_prefill_tokens
        if batch.prefill is not None:
            slot = batch.prefill.ssm_slot
            window = torch.cat([conv_states[slot].to(mixed.dtype), mixed[:split].t()], dim=-1)  # [C, K-1+L]
            conv_states[slot] = window[:, -(self.conv_kernel - 1):].float()
            conv_out = F.silu(F.conv1d(window[None], weight[:, None, :], groups=self.conv_dim)[0]).t()  # [L, C]
            q, k, v = (t.transpose(0, 1) for t in self._split_heads(conv_out))  # [H, L, D]
            g_heads, beta_heads = g[:split].transpose(0, 1), beta[:split].t()  # [H, L, Dk], [H, L]
            capture = getattr(batch, "ssm_capture", None)
            row_states = getattr(batch, "ssm_row_states", None)
            if row_states is not None:
                out, final = self._prefill_every_row(window, mixed[:split], g[:split], beta[:split], rec_states[slot],
                                                     row_states)
            elif capture is None:
                out, final = chunked_kda_rule(q, k, v, g_heads, beta_heads, rec_states[slot])
            else:
                out, final = self._prefill_with_capture(window, q, k, v, g_heads, beta_heads, rec_states[slot],
                                                        capture)
            rec_states[slot] = final
            pieces.append(out.transpose(0, 1))  # [L, H, Dv]
        if batch.decode is not None:
            group = batch.decode
            pieces.append(self._decode_rows(mixed[split:], g[split:], beta[split:], conv_states, rec_states,
                                            group.ssm_slots, group.slot_range))
        core = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [T, H, Dv]
        normed = self.o_norm(core, gate, x.dtype).reshape(-1, self.width)
        return self.fused_out(normed) if self.fused_out is not None else self.o_proj(normed)

    def _split_heads(self, conv_out: torch.Tensor):
        """[T, conv_dim] -> l2-normalised q (scaled), k [T, H, Dk] and v [T, H, Dv], in float32."""
        tokens = conv_out.shape[0]
        q, k, v = (t.view(tokens, self.num_heads, self.head_dim) for t in conv_out.float().split(self.width, -1))
        return _l2norm(q) * self.head_dim ** -0.5, _l2norm(k), v

    def _decode_rows(self, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_states: torch.Tensor,
                     rec_states: torch.Tensor, slots: torch.Tensor,
                     slot_range: tuple[int, int] | None) -> torch.Tensor:
        """One token per sequence: rows [B, conv_dim], g [B, H, Dk], beta [B, H] -> [B, H, Dv].

        The pools are updated in place at ``slots``: on views when the slots are consecutive
        (``slot_range``), else on gathered copies scattered back.
        """
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        if slot_range is not None:
            conv_view, state = conv_states[slot_range[0]:slot_range[1]], rec_states[slot_range[0]:slot_range[1]]
        else:
            conv_view, state = conv_states.index_select(0, slots), rec_states.index_select(0, slots)
        window = torch.cat([conv_view.to(rows.dtype), rows[:, :, None]], dim=-1)  # [B, C, K]
        conv_view.copy_(window[:, :, 1:])
        q, k, v = self._split_heads(F.silu((window * weight).sum(-1)))  # [B, H, D] each
        out = recurrent_kda_step(q, k, v, g, beta, state)
        if slot_range is None:
            conv_states.index_copy_(0, slots, conv_view)
            rec_states.index_copy_(0, slots, state)
        return out

    def _prefill_every_row(self, window: torch.Tensor, rows: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, row_states: SSMRowStates) -> tuple[torch.Tensor, torch.Tensor]:
        """The segment one row at a time through the decode step, keeping every row's state (speculative verify).

        window [conv_dim, K-1+R]; rows [R, conv_dim]; g [R, H, Dk]; beta [R, H]; state [H, Dk, Dv].
        Returns (outputs [H, R, Dv], final state); row r's kept state is the one after rows 0..r.
        """
        num_rows = rows.shape[0]
        conv_pool = window[:, :self.conv_kernel - 1].float()[None].clone()  # [1, C, K-1]: a one-slot pool
        rec_pool = state.clone()[None]  # [1, H, Dk, Dv]
        slot = torch.zeros(1, dtype=torch.long, device=state.device)
        kept_conv = conv_pool.new_empty(num_rows, *conv_pool.shape[1:])
        kept = rec_pool.new_empty(num_rows, *rec_pool.shape[1:])
        outputs = []
        for r in range(num_rows):
            outputs.append(self._decode_rows(rows[r:r + 1], g[r:r + 1], beta[r:r + 1], conv_pool, rec_pool, slot,
                                             (0, 1)))  # [1, H, Dv]
            kept_conv[r], kept[r] = conv_pool[0], rec_pool[0]
        row_states.conv[self.linear_index] = kept_conv
        row_states.recurrent[self.linear_index] = kept
        return torch.cat(outputs).transpose(0, 1), rec_pool[0]

    def _prefill_with_capture(self, window: torch.Tensor, q, k, v, g, beta, state: torch.Tensor,
                              capture: SSMCapture) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill recurrence in two parts, [0, r) and [r, L), recording the state between them.

        window [conv_dim, K-1+L]; q, k, v [H, L, D]; g [H, L, Dk]; beta [H, L]; state [H, Dk, Dv].
        """
        rows = capture.num_rows
        # After r tokens the conv window holds the last K-1 inputs: columns r .. r+K-2.
        capture.conv[self.linear_index] = window[:, rows:rows + self.conv_kernel - 1].float().clone()
        head_out, middle = chunked_kda_rule(q[:, :rows], k[:, :rows], v[:, :rows], g[:, :rows], beta[:, :rows],
                                            state)
        tail_out, final = chunked_kda_rule(q[:, rows:], k[:, rows:], v[:, rows:], g[:, rows:], beta[:, rows:],
                                           middle)
        capture.recurrent[self.linear_index] = middle.clone()
        return torch.cat([head_out, tail_out], dim=1), final
