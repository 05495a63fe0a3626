"""Apply each constrained row's grammar mask to a batch of logits before sampling.

One CPU bitmask for the whole batch ([R, W] int32, one word per 32 tokens), filled row by
row by the matchers, unpacked once and applied with one ``masked_fill``. Rows whose
request has no grammar (or a dormant one, inside a thought) are left as they are.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.grammar.matcher import GrammarState, unpack_bits


@dataclass
class MaskStats:
    num_rows: int = 0          # rows the grammar constrained
    mask_ns: int = 0           # time spent filling and applying the masks


def constrain(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> tuple[torch.Tensor, MaskStats]:
    """``logits`` [B, V] with the disallowed tokens of every constrained row at -inf (a copy when any is)."""
    rows = [i for i, state in enumerate(states) if state is not None and state.is_active]
    if not rows:
        return logits, MaskStats()
    start = time.perf_counter_ns()
    words = states[rows[0]].num_mask_words
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)                   # [R, W]
    filled = [states[i].fill_mask(bitmask[j]) for j, i in enumerate(rows)]
    # A row with no allowed token (a failed matcher) stays free; its request ends on advance.
    kept = [i for i, ok in zip(rows, filled) if ok]
    if kept:
        vocab = logits.shape[1]
        allowed = unpack_bits(bitmask[[j for j, ok in enumerate(filled) if ok]], vocab)  # [K, V']
        if allowed.shape[1] < vocab:    # logits wider than the grammar's vocabulary: padding ids
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        index = torch.tensor(kept, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits, MaskStats(num_rows=len(kept), mask_ns=time.perf_counter_ns() - start)
