"""The MoE blocks' exchange between expert-parallel ranks.

Every rank holds every token (attention is replicated) but computes only its own experts'
assignments: rank r holds rows ``runs[r]`` of the assignments sorted by expert. Both exchanges
end in ``sum_rows`` with each token's rows in global expert order, so the result is bit for
bit the single-rank one on every rank.

- ``AllToAllExchange``: tokens are split into one contiguous slice per rank; each rank sends
  every other rank the rows of that rank's slice (all-to-all), sums the rows of its own slice,
  and an all-gather of the summed slices gives every rank the whole [T, H] output.
- ``AllGatherExchange``: for backends without all-to-all: every rank gathers every rank's
  rows (padded to the longest run) and sums all of them itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.distributed.group import EPGroup, collective
from engine.model.qwen3_5_moe import sum_rows

EXCHANGE_ALL_TO_ALL = "all_to_all"
EXCHANGE_ALL_GATHER = "all_gather"
EXCHANGES = (EXCHANGE_ALL_TO_ALL, EXCHANGE_ALL_GATHER)


def token_slices(num_tokens: int, size: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal token slices [lo, hi), one per rank."""
    base, extra = divmod(num_tokens, size)
    bounds, lo = [], 0
    for rank in range(size):
        hi = lo + base + (rank < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _gather_padded(group: EPGroup, rows: torch.Tensor, counts: list[int], what: str) -> list[torch.Tensor]:
    """All-gather row blocks of known, unequal lengths: each rank's block, unpadded."""
    longest = max(counts)
    padded = rows.new_zeros(longest, rows.shape[1])  # [longest, H]
    padded[: rows.shape[0]] = rows
    every = [torch.empty_like(padded) for _ in range(group.size)]
    with collective(group, what):
        dist.all_gather(every, padded)
    return [block[:count] for block, count in zip(every, counts)]


class AllGatherExchange:
    def __init__(self, group: EPGroup):
        self.group = group
        self.world_size = group.size

    def combine(self, local: torch.Tensor, tokens: torch.Tensor, runs: list[tuple[int, int]],
                num_tokens: int) -> torch.Tensor:
        blocks = _gather_padded(self.group, local, [hi - lo for lo, hi in runs], "MoE all-gather")
        return sum_rows(tokens, torch.cat(blocks), num_tokens)  # [T, H]


class AllToAllExchange:
    def __init__(self, group: EPGroup):
        self.group = group
        self.world_size = group.size

    def combine(self, local: torch.Tensor, tokens: torch.Tensor, runs: list[tuple[int, int]],
                num_tokens: int) -> torch.Tensor:
        size, me = self.group.size, self.group.rank
        slices = token_slices(num_tokens, size)
        slice_starts = torch.tensor([lo for lo, _ in slices[1:]], dtype=torch.long, device=tokens.device)
        # dest[r]: the rank whose token slice each of rank r's rows belongs to (every rank knows every run).
        dest = [torch.bucketize(tokens[lo:hi], slice_starts, right=True) for lo, hi in runs]
        counts = [torch.bincount(d, minlength=size).tolist() for d in dest]  # counts[src][dst]
        order = torch.argsort(dest[me], stable=True)  # my rows grouped by destination, expert order kept
        received = local.new_empty(sum(counts[src][me] for src in range(size)), local.shape[1])
        with collective(self.group, "MoE all-to-all"):
            dist.all_to_all_single(received, local.index_select(0, order).contiguous(),
                                   output_split_sizes=[counts[src][me] for src in range(size)],
                                   input_split_sizes=counts[me])
        # The tokens of the received rows: source by source, each source's rows for my slice in its order.
        mine = torch.cat([tokens[lo:hi][dest[src] == me] for src, (lo, hi) in enumerate(runs)])
        lo, hi = slices[me]
        summed = sum_rows(mine - lo, received, hi - lo)  # [T_me, H]
        blocks = _gather_padded(self.group, summed, [b - a for a, b in slices], "MoE all-gather of token slices")
        return torch.cat(blocks)  # [T, H]


def make_exchange(kind: str, group: EPGroup):
    if kind == EXCHANGE_ALL_TO_ALL:
        return AllToAllExchange(group)
    if kind == EXCHANGE_ALL_GATHER:
        return AllGatherExchange(group)
    raise ValueError(f"--ep-exchange must be one of {EXCHANGES}, got {kind!r}")
