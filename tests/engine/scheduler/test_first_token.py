"""First-token policy: min_tokens, thinking, forced tool call, grammar, min-p override."""
import pytest
import torch

from engine.scheduler.first_token import (
    RULE_FORCE_TOOL_CALL,
    RULE_MIN_TOKENS,
    RULE_THINKING,
    FirstTokenPolicy,
    sample_first_token,
)
from engine.scheduler.sampling import SamplingParams, make_generator

V = 16
EOS, THINK_END, TOOL_START, STOP = 1, 2, 3, 4


def birth(thinking=False, min_tokens=0, require_tool=False, think_end=THINK_END, tool=TOOL_START):
    return FirstTokenPolicy.for_birth(thinking, think_end, tool, min_tokens, require_tool)


def peaked(order):
    """Logits [V] whose argmax is order[0], then order[1], ... (everything else far below)."""
    logits = torch.full((V,), -10.0)
    for rank, tok in enumerate(order):
        logits[tok] = 10.0 - rank
    return logits


def first(logits, policy, params=SamplingParams(), **kw):
    return sample_first_token(logits, params, make_generator(params.seed), policy, {EOS}, **kw)


def test_plain_policy_bans_nothing():
    p = birth()
    assert p == FirstTokenPolicy(frozenset(), False, None, True, ())
    assert first(peaked([EOS, 7]), p) == EOS


def test_min_tokens_forbids_eos_and_stop_at_token_zero():
    p = birth(min_tokens=3)
    assert p.rules == (RULE_MIN_TOKENS,) and p.ban_eos
    params = SamplingParams(min_tokens=3, stop_token_ids=(STOP,))
    assert first(peaked([EOS, STOP, 9]), p, params) == 9
    assert p.banned_for({EOS}, (STOP,)) == {EOS, STOP}


def test_thinking_bans_think_end_eos_and_tool_start():
    p = birth(thinking=True)
    assert p.rules == (RULE_THINKING,) and not p.grammar_applies
    assert p.banned_for({EOS}, ()) == {EOS, THINK_END, TOOL_START}
    assert first(peaked([THINK_END, EOS, TOOL_START, 11]), p) == 11


def test_thinking_defers_a_required_tool_call():
    p = birth(thinking=True, require_tool=True)
    assert p.forced_token is None and RULE_FORCE_TOOL_CALL not in p.rules
    assert first(peaked([TOOL_START, 5]), p) == 5


def test_thinking_without_model_tokens_still_bans_eos():
    p = birth(thinking=True, think_end=None, tool=None)
    assert p.banned_ids == frozenset() and p.ban_eos
    assert first(peaked([EOS, 6]), p) == 6


def test_required_tool_call_forces_the_start_token():
    p = birth(require_tool=True, min_tokens=2)
    assert p.forced_token == TOOL_START and p.rules == (RULE_MIN_TOKENS, RULE_FORCE_TOOL_CALL)
    assert not p.grammar_applies
    hot = SamplingParams(temperature=1.0, seed=0)
    assert first(peaked([9, 8]), p, hot) == TOOL_START


def test_required_tool_call_without_token_is_a_clear_error():
    with pytest.raises(ValueError, match="tool_call_start_token"):
        birth(require_tool=True, tool=None)
    with pytest.raises(ValueError, match="min_tokens"):
        birth(min_tokens=-1)


def test_forced_token_outside_vocab_is_an_error():
    p = FirstTokenPolicy.for_birth(False, None, V + 5, 0, True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        first(peaked([0]), p)


def test_grammar_constrains_token_zero_only_when_it_applies():
    logits = peaked([7, 8, 9])
    assert first(logits, birth(), grammar_allowed_ids={9, 12}) == 9
    # under thinking the grammar waits for the answer
    assert first(logits, birth(thinking=True), grammar_allowed_ids={9}) == 7


def test_everything_banned_is_a_clear_error():
    with pytest.raises(ValueError, match="every token is banned"):
        first(peaked([0]), birth(min_tokens=1), grammar_allowed_ids={EOS})


def test_min_p_override_reaches_the_sampler():
    # token 0 has p=0.4; the rest are low. min_p 0.9 would keep only token 0.
    logits = torch.log(torch.tensor([0.4] + [0.6 / (V - 1)] * (V - 1)))
    params = [SamplingParams(temperature=1.0, min_p=0.9, seed=s) for s in range(40)]
    strict = {first(logits, birth(), p) for p in params}
    relaxed = {first(logits, birth(), p, min_p_override=0.0) for p in params}
    assert strict == {0} and len(relaxed) > 1


def test_seeded_first_token_replays():
    logits = torch.zeros(V)
    p = SamplingParams(temperature=1.0, seed=42)
    assert len({first(logits, birth(), p) for _ in range(5)}) == 1


def test_bad_logits_shape():
    with pytest.raises(ValueError, match=r"must be \[V\]"):
        first(torch.zeros(1, V), birth())
