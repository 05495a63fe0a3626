"""The Kimi Delta Attention recurrence: a gated delta rule whose forget gate decays each key channel.

State per head is a matrix S [Dk, Dv]. One token t does
    S <- diag(exp(g_t)) S                   (g_t [Dk]: one log-decay per key channel)
    u_t = beta_t * (v_t - S^T k_t)          (the delta: what S fails to predict)
    S <- S + k_t u_t^T
    o_t = S^T q_t
Gated DeltaNet (gdn_rule.py) is the special case of one decay per head. The prefill path runs
the same recurrence a chunk of C tokens at a time; with per-channel decays the pairwise decay
between tokens i >= j of a chunk, exp(G_i - G_j) (G the in-chunk cumulative log-decay), is a
[C, C, Dk] tensor, so it is built per chunk instead of for the whole prompt at once: its
memory stays C * C * Dk per head whatever the prompt length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.gdn_rule import LOG_DECAY_FLOOR

# 16 keeps the per-chunk pairwise decay ([H, C, C, Dk]) small; the Python loop over chunks
# costs 1 / C, the [C, C, Dk] products scale with C.
CHUNK_SIZE = 16


def chunked_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [H, L, Dk]; v: [H, L, Dv]; g: [H, L, Dk] log-decays (<= 0); beta: [H, L]; state: [H, Dk, Dv].

    All float32; q already scaled. Returns (outputs [H, L, Dv], final state [H, Dk, Dv]).
    """
    heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    chunk = min(chunk_size, length)
    pad = (-length) % chunk
    if pad:
        # Padded tokens have beta = 0 (no write) and g = 0 (no decay): the state passes through.
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    num_chunks = (length + pad) // chunk
    q, k, g = (x.reshape(heads, num_chunks, chunk, key_dim) for x in (q, k, g))
    v = v.reshape(heads, num_chunks, chunk, value_dim)
    beta = beta.reshape(heads, num_chunks, chunk)
    log_decay = g.cumsum(-2)  # [H, N, C, Dk]: log decay from the chunk start through token i
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril_(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril_()
    outputs = q.new_empty(heads, num_chunks, chunk, value_dim)
    for n in range(num_chunks):
        qn, kn, vn, bn, gn = q[:, n], k[:, n], v[:, n], beta[:, n], log_decay[:, n]  # [H, C, *]
        # pair[h, i, j, d] = exp(G_i - G_j), used for j <= i only (clamped to <= 0 above it).
        pair = (gn[:, :, None, :] - gn[:, None, :, :]).clamp_(LOG_DECAY_FLOOR, 0.0).exp_()  # [H, C, C, Dk]
        k_pair = kn[:, None, :, :] * pair  # [H, C(i), C(j), Dk]: k_j decayed to token i
        # (I + A) U = beta V - beta (exp(G) * K) S0, A_ij = beta_i sum_d k_i,d k_j,d exp(G_i,d - G_j,d), j < i.
        system = (k_pair * kn[:, :, None, :]).sum(-1).mul_(bn[..., None]).masked_fill_(~strict, 0.0)  # [H, C, C]
        decay = gn.clamp(min=LOG_DECAY_FLOOR).exp()  # [H, C, Dk]
        rhs = torch.cat([vn * bn[..., None], kn * decay * bn[..., None]], dim=-1)  # [H, C, Dv + Dk]
        system.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = torch.baddbmm(solved[..., :value_dim], solved[..., value_dim:], state, alpha=-1)  # [H, C, Dv]
        intra = (k_pair * qn[:, :, None, :]).sum(-1).masked_fill_(~causal, 0.0)  # [H, C, C]
        outputs[:, n] = torch.baddbmm((qn * decay) @ state, intra, u)
        last = gn[:, -1:, :]  # [H, 1, Dk]
        to_end = (last - gn).clamp_(min=LOG_DECAY_FLOOR).exp_()  # [H, C, Dk]
        state = torch.baddbmm(state * last.clamp(min=LOG_DECAY_FLOOR).exp().transpose(1, 2),
                              (kn * to_end).transpose(1, 2), u)
    return outputs.view(heads, num_chunks * chunk, value_dim)[:, :length], state


def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> torch.Tensor:
    """One token per sequence, batched, updating ``state`` IN PLACE; returns outputs [B, H, Dv].

    q, k [B, H, Dk]; v [B, H, Dv]; g [B, H, Dk]; beta [B, H]; state [B, H, Dk, Dv] (may be a pool view).
    With S' = D S + k delta^T, the output q^T S' = q^T D S + (q . k) delta: one [2, Dk] @ [Dk, Dv]
    matmul per head reads both k^T D S and q^T D S before the rank-1 update.
    """
    batch, heads, key_dim = k.shape
    state.mul_(g.exp()[..., None])
    read = torch.stack([k, q], dim=-2) @ state  # [B, H, 2, Dv]
    delta = (v - read[..., 0, :]) * beta[..., None]  # [B, H, Dv]
    state.view(batch * heads, key_dim, -1).baddbmm_(k.reshape(batch * heads, key_dim, 1),
                                                     delta.view(batch * heads, 1, -1))
    return read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta
