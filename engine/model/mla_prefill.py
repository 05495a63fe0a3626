"""Chunked MLA prefill: a chunk's queries over its cached context plus its own tokens, merged exactly.

A chunk at positions [start, start + L) must see every cached token before it. Its context
lives in the paged cache only as latents, so it is read in bounded sub-chunks of positions:
each is gathered through the block table, up-projected to per-head K/V and attended without a
mask (every context position precedes every query). The chunk's own tokens are attended
causally. Each part yields an output and the log-sum-exp of its scores; two parts over disjoint
keys merge exactly by rescaling with their log-sum-exps, so the result equals one softmax over
all ``start + L`` keys, in memory bounded by the sub-chunk (and query block) sizes.

This is the step vLLM got wrong at first for MLA chunked prefill (vllm#26042) and disabled
chunked prefill for instead (vllm#12642); tests/engine/model/test_mla_prefill.py checks it
against a whole-prompt forward, with and without cached context, over several sub-chunks.
"""
from __future__ import annotations

from typing import Callable

import torch

# Context positions per gathered, up-projected sub-chunk: bounds the [H, S, D] K/V it expands to.
CONTEXT_SUB_CHUNK = 256
# Query rows per block of the score matrix: bounds the [H, Q, S] scores whatever the chunk length.
QUERY_BLOCK = 256


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, L, Dqk], k [H, S, Dqk], v [H, S, Dv] -> (out [H, L, Dv], lse [H, L]), both float32.

    ``causal_offset`` None: every query sees every key. An int o: query i sees keys j <= i + o
    (a chunk's own tokens: o = 0). Queries run in blocks of QUERY_BLOCK rows.
    """
    q, k, v = q.float(), k.float(), v.float()
    length, keys = q.shape[1], k.shape[1]
    outs, lses = [], []
    for first in range(0, length, QUERY_BLOCK):
        block = q[:, first:first + QUERY_BLOCK]  # [H, Q, Dqk]
        scores = (block @ k.transpose(1, 2)).mul_(scale)  # [H, Q, S]
        if causal_offset is not None:
            rows = torch.arange(first, first + block.shape[1], device=q.device)[:, None] + causal_offset
            scores.masked_fill_(torch.arange(keys, device=q.device)[None, :] > rows, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, Q]
        outs.append(torch.exp(scores - lse[..., None]) @ v)  # [H, Q, Dv]
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint key sets -> the result over their union.

    out [H, L, Dv], lse [H, L] (float32). A part whose keys a row cannot see has lse -inf there
    and weight 0; the union always has a visible key (a row sees at least itself).
    """
    lse = torch.logaddexp(lse_a, lse_b)  # [H, L]
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


def chunk_over_context(q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, context_len: int,
                       read_context: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], scale: float,
                       sub_chunk: int = CONTEXT_SUB_CHUNK) -> torch.Tensor:
    """A chunk's attention over ``context_len`` cached positions and its own tokens -> [H, L, Dv] float32.

    q, own_k [H, L, Dqk]; own_v [H, L, Dv]. ``read_context(a, b)`` returns the up-projected K
    [H, b - a, Dqk] and V [H, b - a, Dv] of context positions [a, b); it is called for
    consecutive ranges of at most ``sub_chunk`` positions covering [0, context_len).
    """
    if sub_chunk < 1:
        raise ValueError(f"sub_chunk must be >= 1, got {sub_chunk}")
    out, lse = attention_with_lse(q, own_k, own_v, scale, causal_offset=0)
    for first in range(0, context_len, sub_chunk):
        k, v = read_context(first, min(first + sub_chunk, context_len))
        part, part_lse = attention_with_lse(q, k, v, scale)
        out, lse = merge_partials(out, lse, part, part_lse)
    return out
