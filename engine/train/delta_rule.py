"""The chunked gated delta rule in autograd-friendly ops, for training.

Same math, chunking and decay clamps as ``engine/model/gdn_rule.chunked_gated_delta_rule`` (the
serving form writes into preallocated buffers with ``out=`` and in-place ops, which autograd
refuses); tests/engine/train/test_delta_rule.py checks that the two agree.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.gdn_rule import CHUNK_SIZE, LOG_DECAY_FLOOR


def differentiable_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, state: torch.Tensor,
                                    chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [Hk, L, Dk]; v: [Hv, L, Dv]; g, beta: [Hv, L]; state: [Hv, Dk, Dv].

    Returns (outputs [Hv, L, Dv], final state [Hv, Dk, Dv]), differentiable in every input.
    """
    # A copy: ``state`` is a view of the pool slot the caller overwrites with the result, which
    # would change a tensor the backward pass reads.
    state = state.clone()
    num_k_heads, length, key_dim = q.shape
    num_heads, value_dim = v.shape[0], v.shape[-1]
    group = num_heads // num_k_heads
    chunk = min(chunk_size, length)
    pad = (-length) % chunk
    if pad:  # beta = 0, g = 0 on the padding: the state passes through
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (length + pad) // chunk
    q, k = (x.reshape(num_k_heads, 1, num_chunks, chunk, key_dim) for x in (q, k))  # [Hk, 1, N, C, Dk]
    v = v.reshape(num_k_heads, group, num_chunks, chunk, value_dim)  # [Hk, G, N, C, Dv]
    g = g.reshape(num_k_heads, group, num_chunks, chunk)
    beta = beta.reshape(num_k_heads, group, num_chunks, chunk)  # [Hk, G, N, C]

    log_decay = g.cumsum(-1)  # [Hk, G, N, C]
    decay = log_decay.clamp(min=LOG_DECAY_FLOOR).exp()
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).clamp(LOG_DECAY_FLOOR, 0.0).exp()  # [.., C, C]
    # (I + A) X = [beta V | beta decay K], A strictly lower: beta_i decay_ij k_i.k_j
    system = ((k @ k.mT) * beta[..., None] * pair_decay).tril(-1)  # [Hk, G, N, C, C]
    rhs = torch.cat([v * beta[..., None], (k * (beta * decay)[..., None])], dim=-1)  # [Hk, G, N, C, Dv + Dk]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    solved = solved.reshape(num_heads, num_chunks, chunk, value_dim + key_dim)
    u_from_v, u_from_state = solved.split([value_dim, key_dim], dim=-1)  # [H, N, C, Dv], [H, N, C, Dk]

    intra = ((q @ k.mT) * pair_decay).tril().reshape(num_heads, num_chunks, chunk, chunk)  # [H, N, C, C]
    q_decayed = (q * decay[..., None]).reshape(num_heads, num_chunks, chunk, key_dim)
    chunk_log_decay = log_decay[..., -1:]  # [Hk, G, N, 1]
    to_end = (chunk_log_decay - log_decay).clamp(min=LOG_DECAY_FLOOR).exp()  # [Hk, G, N, C]
    k_to_end = (k * to_end[..., None]).reshape(num_heads, num_chunks, chunk, key_dim).mT  # [H, N, Dk, C]
    chunk_decay = chunk_log_decay.clamp(min=LOG_DECAY_FLOOR).exp().reshape(num_heads, num_chunks, 1, 1)

    outputs = []
    for n in range(num_chunks):
        u = u_from_v[:, n] - u_from_state[:, n] @ state  # [H, C, Dv]
        outputs.append(q_decayed[:, n] @ state + intra[:, n] @ u)  # [H, C, Dv]
        state = state * chunk_decay[:, n] + k_to_end[:, n] @ u  # [H, Dk, Dv]
    return torch.cat(outputs, dim=1)[:, :length], state
