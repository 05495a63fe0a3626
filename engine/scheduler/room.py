"""Which decode rows wait a tick when the KV cache cannot give every row its next block.

Pure decision code. It only matters when nobody may be preempted (every active sequence
holds a grammar, ``preempt.py``): the rows that need no new block always decode; the free
blocks go to the rows that need one in admission order (the oldest first, so the request
closest to its end is served and frees its blocks soonest); the rest wait.
"""
from __future__ import annotations

from collections.abc import Sequence


def rows_that_wait(needs: Sequence[int], admitted_ticks: Sequence[int], num_free: int) -> list[int]:
    """Indices of the rows that get no block this tick, in row order.

    ``needs[i]``: new blocks row i's next token needs (0 or 1); ``admitted_ticks[i]``: its admission tick.
    """
    if len(needs) != len(admitted_ticks):
        raise ValueError(f"{len(needs)} needs for {len(admitted_ticks)} admission ticks")
    order = sorted((i for i, need in enumerate(needs) if need > 0), key=lambda i: (admitted_ticks[i], i))
    waiting = []
    for i in order:
        if needs[i] <= num_free:
            num_free -= needs[i]
        else:
            waiting.append(i)
    return sorted(waiting)
