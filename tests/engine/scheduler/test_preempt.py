"""Victim choice: each policy, ties, grammar exemption, unknown policy."""
import itertools

import pytest

from engine.scheduler.preempt import PREEMPT_POLICIES, VictimCandidate, choose_victim


def cand(rid, blocks, tick, out=0, grammar=False):
    return VictimCandidate(request_id=rid, num_blocks=blocks, has_grammar=grammar,
                           admitted_tick=tick, num_output_tokens=out)


POOL = [
    cand(1, blocks=8, tick=1, out=40),
    cand(2, blocks=12, tick=2, out=30, grammar=True),   # the most blocks, but has a grammar
    cand(3, blocks=10, tick=3, out=5),
    cand(4, blocks=3, tick=9, out=12),
]


@pytest.mark.parametrize("policy, expected", [
    ("most_blocks", 3),       # 2 holds more but has a grammar
    ("newest", 4),
    ("fewest_output", 3),
])
def test_each_policy(policy, expected):
    assert choose_victim(POOL, policy) == expected


@pytest.mark.parametrize("policy, pool, expected", [
    # most_blocks tie: newest admitted wins
    ("most_blocks", [cand(1, 6, 1), cand(2, 6, 5), cand(3, 2, 9)], 2),
    # most_blocks tie on blocks and tick: larger request id
    ("most_blocks", [cand(7, 6, 1), cand(4, 6, 1)], 7),
    # newest tie: more blocks
    ("newest", [cand(1, 2, 4), cand(2, 9, 4), cand(3, 1, 3)], 2),
    # fewest_output tie: more blocks, then newest
    ("fewest_output", [cand(1, 2, 1, out=0), cand(2, 5, 0, out=0), cand(3, 9, 9, out=1)], 2),
    ("fewest_output", [cand(1, 5, 1, out=0), cand(2, 5, 3, out=0)], 2),
])
def test_ties_are_deterministic(policy, pool, expected):
    for perm in itertools.permutations(pool):  # the list order never matters
        assert choose_victim(list(perm), policy) == expected


@pytest.mark.parametrize("policy", PREEMPT_POLICIES)
def test_nobody_qualifies(policy):
    assert choose_victim([], policy) is None
    assert choose_victim([cand(1, 9, 1, grammar=True), cand(2, 4, 2, grammar=True)], policy) is None


@pytest.mark.parametrize("policy", PREEMPT_POLICIES)
def test_grammar_sequences_are_never_victims(policy):
    pool = [cand(1, 100, 100, out=0, grammar=True), cand(2, 1, 0, out=99)]
    assert choose_victim(pool, policy) == 2


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="preempt_policy must be one of.*'oldest'"):
        choose_victim(POOL, "oldest")
    with pytest.raises(ValueError, match="preempt_policy"):
        choose_victim([], "oldest")
