"""The can-mix rule: may this tick fuse the prefill chunk with the decode batch?

Pure decisions of the mixed path, on plain values:

- ``can_mix``: the verdict and the first blocker, in the reference's order
  (no-mix bisect lever, no active decodes, expert parallelism, speculation
  at this width);
- ``mixing_blocked_by_spec``: the width rule for speculation;
- ``plan_draft_drop``: what a mixed tick under speculation does with drafts;
- ``decode_order``: the row order of the fused decode batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.spec.kinds import is_speculative
from telemetry.events import BLOCK_BISECT, BLOCK_EXPERT_PARALLEL, BLOCK_NO_DECODES, BLOCK_SPECULATION

def mixing_blocked_by_spec(num_active: int, any_spec: bool) -> bool:
    """Does speculation stop mixing at this decode width?

    Width rule (from the reference's comment that a speculative serve still
    fuses when more than one sequence is active): the speculative
    draft-and-verify step only runs when exactly one sequence decodes, and
    that step cannot be fused with a prefill chunk. With two or more active
    sequences the decode is a plain one and fuses. With none active there is
    no speculative step to protect (the "no active decodes" blocker applies).
    """
    if num_active < 0:
        raise ValueError(f"num_active must be >= 0, got {num_active}")
    return any_spec and num_active == 1


@dataclass(frozen=True)
class MixVerdict:
    can_mix: bool
    blocker: str | None      # the first BLOCK_* that stopped mixing, None when mixing is allowed


def can_mix(*, bisect_no_mix: bool, num_active: int, is_ep: bool, speculation: str) -> MixVerdict:
    """The verdict and, when several rules block, the first one in the reference's order."""
    any_spec = is_speculative(speculation)
    if bisect_no_mix:
        return MixVerdict(False, BLOCK_BISECT)
    if num_active == 0:
        return MixVerdict(False, BLOCK_NO_DECODES)
    if is_ep:
        return MixVerdict(False, BLOCK_EXPERT_PARALLEL)
    if mixing_blocked_by_spec(num_active, any_spec):
        return MixVerdict(False, BLOCK_SPECULATION)
    return MixVerdict(True, None)


@dataclass(frozen=True)
class DraftDrop:
    drop_drafts: bool        # clear every sequence's pending drafts and confidences
    sync_secondary: bool     # wait for the secondary stream (the last verify's async copies)
    num_dropped: int         # drafts thrown away, for telemetry


def plan_draft_drop(speculation: str, num_pending_drafts: Sequence[int]) -> DraftDrop:
    """Before a fused forward under speculation, drafts are dropped; sync only when any were pending.

    The fused step is a plain decode, so drafts from the last verify would be
    stale; their async state copies run on the secondary stream, which must
    finish before the fused forward reads that state.
    """
    if not is_speculative(speculation):
        return DraftDrop(False, False, 0)
    num_dropped = sum(num_pending_drafts)
    return DraftDrop(True, num_dropped > 0, num_dropped)


def decode_order(ssm_slots: Sequence[int | None], slots: Sequence[int]) -> list[int]:
    """Row order of the fused decode batch: by SSM pool slot (falling back to the sequence slot).

    The batched linear-attention recurrence wants its sequences on
    consecutive pool slots in row order. Returns indices into the inputs;
    Python's sort is stable, so equal keys keep their original order.
    """
    if len(ssm_slots) != len(slots):
        raise ValueError(f"ssm_slots has {len(ssm_slots)} entries for {len(slots)} slots")
    keys = [s if s is not None else fallback for s, fallback in zip(ssm_slots, slots)]
    return sorted(range(len(keys)), key=keys.__getitem__)
