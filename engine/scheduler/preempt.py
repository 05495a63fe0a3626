"""Victim choice when a prefill chunk finds the KV cache exhausted.

The reference ends one active sequence, frees its blocks, and retries the
chunk, until the chunk fits or nobody qualifies. A sequence with a grammar
is never a victim (its constrained state cannot be rebuilt cheaply). The
``preempt_policy`` lever picks among the rest:

- ``most_blocks`` (the reference): the one holding the most KV blocks, so
  one victim frees as much as possible;
- ``newest``: the latest admitted, which loses the least finished work;
- ``fewest_output``: the one with the fewest generated tokens.

Ties never depend on the order of the candidate list: each policy breaks
them by the keys listed in ``_KEYS`` and finally by the larger request id,
so the same state always picks the same victim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

POLICY_MOST_BLOCKS = "most_blocks"
POLICY_NEWEST = "newest"
POLICY_FEWEST_OUTPUT = "fewest_output"
PREEMPT_POLICIES = (POLICY_MOST_BLOCKS, POLICY_NEWEST, POLICY_FEWEST_OUTPUT)

PREEMPT_ERROR = "preempted: KV cache exhausted (a prefill needed its blocks)"


@dataclass(frozen=True)
class VictimCandidate:
    request_id: int
    num_blocks: int
    has_grammar: bool
    admitted_tick: int          # admission order: larger = admitted later
    num_output_tokens: int


# Larger key = better victim. Every key ends in the request id for a total order.
_KEYS: dict[str, Callable[[VictimCandidate], tuple]] = {
    # most blocks; ties: the newest admitted (least work lost)
    POLICY_MOST_BLOCKS: lambda c: (c.num_blocks, c.admitted_tick, c.request_id),
    # newest admitted; ties: the one holding more blocks
    POLICY_NEWEST: lambda c: (c.admitted_tick, c.num_blocks, c.request_id),
    # fewest output tokens; ties: more blocks, then newest
    POLICY_FEWEST_OUTPUT: lambda c: (-c.num_output_tokens, c.num_blocks, c.admitted_tick, c.request_id),
}


def choose_victim(candidates: Sequence[VictimCandidate], policy: str) -> int | None:
    """The request id of the sequence to preempt, or None when no candidate qualifies."""
    if policy not in _KEYS:
        raise ValueError(f"preempt_policy must be one of {PREEMPT_POLICIES}, got {policy!r}")
    eligible = [c for c in candidates if not c.has_grammar]
    if not eligible:
        return None
    return max(eligible, key=_KEYS[policy]).request_id
