"""Apply each constrained row's grammar mask to a batch of logits before sampling.

One bitmask for the whole batch ([B, W] int32, one word per 32 tokens; rows without a grammar,
or with a dormant one inside a thought, stay all ones), filled row by row by the matchers,
unpacked once and applied with one ``masked_fill``: at a small vocabulary the fixed cost of
each torch op outweighs the matchers' own work, so the ops are kept to a few per batch.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    batch, vocab = logits.shape
    bitmask = np.full((batch, states[rows[0]].num_mask_words), -1, dtype=np.int32)   # [B, W]
    num_rows = 0
    for i in rows:
        if states[i].fill_mask(bitmask[i]):
            num_rows += 1
        else:
            bitmask[i] = -1   # a failed matcher leaves its row free; its request ends on advance
    allowed = unpack_bits(bitmask, vocab)                                             # [B, <=V]
    if allowed.shape[1] < vocab:    # logits wider than the grammar's vocabulary: padding ids
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits, MaskStats(num_rows=num_rows, mask_ns=time.perf_counter_ns() - start)
