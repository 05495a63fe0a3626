"""The can-mix rule: every blocker, their order, the speculation width rule, drafts, decode order."""
import itertools

import pytest

from engine.scheduler.mixing import (DraftDrop, MixVerdict, can_mix, decode_order, mixing_blocked_by_spec,
                                     plan_draft_drop)
from engine.spec.kinds import SPECULATION_KINDS, is_speculative
from telemetry.events import BLOCK_BISECT, BLOCK_EXPERT_PARALLEL, BLOCK_NO_DECODES, BLOCK_SPECULATION

# (bisect_no_mix, num_active, is_ep, speculation) -> expected verdict
CASES = [
    (False, 3, False, "off", MixVerdict(True, None)),
    (False, 1, False, "off", MixVerdict(True, None)),
    (True, 3, False, "off", MixVerdict(False, BLOCK_BISECT)),
    (False, 0, False, "off", MixVerdict(False, BLOCK_NO_DECODES)),
    (False, 2, True, "off", MixVerdict(False, BLOCK_EXPERT_PARALLEL)),
    (False, 1, False, "mtp", MixVerdict(False, BLOCK_SPECULATION)),
    (False, 1, False, "self", MixVerdict(False, BLOCK_SPECULATION)),
    (False, 1, False, "ngram", MixVerdict(False, BLOCK_SPECULATION)),
    (False, 2, False, "mtp", MixVerdict(True, None)),       # wider than one: speculation still fuses
    (False, 8, False, "ngram", MixVerdict(True, None)),
    # several blockers: the first in the reference's order wins
    (True, 0, True, "mtp", MixVerdict(False, BLOCK_BISECT)),
    (False, 0, True, "mtp", MixVerdict(False, BLOCK_NO_DECODES)),
    (False, 1, True, "mtp", MixVerdict(False, BLOCK_EXPERT_PARALLEL)),
    (True, 1, False, "mtp", MixVerdict(False, BLOCK_BISECT)),
]


@pytest.mark.parametrize("bisect, num_active, is_ep, spec, expected", CASES)
def test_can_mix_table(bisect, num_active, is_ep, spec, expected):
    assert can_mix(bisect_no_mix=bisect, num_active=num_active, is_ep=is_ep, speculation=spec) == expected


def test_verdict_is_consistent_with_blocker_everywhere():
    for bisect, n, ep, spec in itertools.product([False, True], [0, 1, 2, 5], [False, True], SPECULATION_KINDS):
        v = can_mix(bisect_no_mix=bisect, num_active=n, is_ep=ep, speculation=spec)
        assert v.can_mix == (v.blocker is None)
        assert v.can_mix == (not bisect and n > 0 and not ep and not (spec != "off" and n == 1))


@pytest.mark.parametrize("num_active, any_spec, blocked", [
    (0, True, False), (1, True, True), (2, True, False), (7, True, False), (1, False, False), (0, False, False),
])
def test_spec_width_rule(num_active, any_spec, blocked):
    assert mixing_blocked_by_spec(num_active, any_spec) is blocked


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="speculation must be one of"):
        can_mix(bisect_no_mix=False, num_active=1, is_ep=False, speculation="eagle")
    with pytest.raises(ValueError, match="num_active"):
        mixing_blocked_by_spec(-1, True)
    with pytest.raises(ValueError, match="ssm_slots"):
        decode_order([1], [1, 2])
    assert not is_speculative("off") and is_speculative("mtp")


def test_draft_drop():
    assert plan_draft_drop("off", [3, 1]) == DraftDrop(False, False, 0)
    assert plan_draft_drop("mtp", [0, 0]) == DraftDrop(True, False, 0)
    assert plan_draft_drop("ngram", [2, 0, 3]) == DraftDrop(True, True, 5)
    assert plan_draft_drop("self", []) == DraftDrop(True, False, 0)


def test_decode_order_sorts_by_ssm_slot_with_fallback():
    # ssm slots 5, None (slot 2), 0, 5 -> keys 5, 2, 0, 5; stable for the tie
    assert decode_order([5, None, 0, 5], [9, 2, 7, 1]) == [2, 1, 0, 3]
    assert decode_order([], []) == []
