"""The helpers every generator shares (lengths, token ids, sampling mixes, numbering, summaries), held to
the engine's own checks: a generated request must be one the scheduler accepts as it is."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from engine.grammar.spec import GrammarSpec
from engine.scheduler.sampling import SamplingParams
from engine.workload.grammars import GRAMMAR_MAX_TOKENS, builtin_grammars, draw_grammar
from engine.workload.multiturn import MultiTurnWorkload
from engine.workload.request import (
    SAMPLING_KEYS,
    RequestSpec,
    TokenDrawer,
    WorkloadError,
    check_positive,
    clipped_lognormal,
    greedy_sampling,
    length_summary,
    mixed_sampling,
    sort_and_number,
)
from engine.workload.synthetic import SyntheticWorkload, arrival_gaps


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), median=st.floats(0.5, 5000), sigma=st.floats(0, 3),
       low=st.integers(1, 100), span=st.integers(0, 1000))
def test_clipped_lengths_stay_in_bounds(seed, median, sigma, low, span):
    value = clipped_lognormal(random.Random(seed), median, sigma, low, low + span)
    assert isinstance(value, int) and low <= value <= low + span


def test_zero_sigma_gives_the_median_and_a_seed_gives_the_same_draws():
    assert {clipped_lognormal(random.Random(s), 37.4, 0.0, 1, 100) for s in range(5)} == {37}
    draws = [clipped_lognormal(random.Random(9), 50, 0.8, 1, 10_000) for _ in range(3)]
    assert len(set(draws)) == 1
    spread = {clipped_lognormal(random.Random(s), 50, 0.8, 1, 10_000) for s in range(50)}
    assert len(spread) > 10 and min(spread) < 50 < max(spread)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), max_tokens=st.integers(1, 512), greedy=st.floats(0, 1),
       force=st.booleans())
def test_every_sampling_mix_is_one_the_engine_accepts(seed, max_tokens, greedy, force):
    sampling = mixed_sampling(random.Random(seed), max_tokens, greedy, force_length=force)
    assert tuple(sampling) == SAMPLING_KEYS
    params = SamplingParams.from_dict(sampling).validate(vocab_size=1000)
    assert params.max_tokens == max_tokens and params.min_tokens == (max_tokens if force else 0)
    assert 0 <= params.seed < 2**31


def test_the_greedy_share_is_honoured_at_its_ends():
    rng = random.Random(3)
    assert all(mixed_sampling(rng, 8, 1.0)["temperature"] == 0.0 for _ in range(50))
    assert all(mixed_sampling(rng, 8, 0.0)["temperature"] > 0.0 for _ in range(50))
    assert greedy_sampling(5, force_length=False, seed=4) == {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                                              "min_p": 0.0, "min_tokens": 0, "max_tokens": 5,
                                                              "seed": 4}


def test_the_token_drawer_never_draws_an_excluded_id():
    drawer = TokenDrawer(10, excluded_ids=[0, 9, 42])
    assert drawer.num_excluded == 2, "an id outside the vocabulary excludes nothing"
    drawn = drawer.draw(random.Random(1), 2000)
    assert set(drawn) == set(range(1, 9))
    assert TokenDrawer(1).draw(random.Random(0), 3) == [0, 0, 0]
    for bad in (0, -1, True, 2.0, "10"):
        with pytest.raises(WorkloadError, match="vocab_size must be a positive int"):
            TokenDrawer(bad)


@pytest.mark.parametrize("value, kwargs, ok", [
    (1, {}, True), (0.5, {}, True), (0, {}, False), (0, {"allow_zero": True}, True), (-1e-9, {"allow_zero": True}, False),
    (float("nan"), {}, False), (float("inf"), {}, False), (True, {}, False), ("3", {}, False),
    (2.0, {"integer": True}, False), (2, {"integer": True}, True),
])
def test_check_positive(value, kwargs, ok):
    if ok:
        check_positive("knob", value, **kwargs)
    else:
        with pytest.raises(WorkloadError, match=r"knob must be (an int|a number) (>|>=) 0"):
            check_positive("knob", value, **kwargs)


def spec(arrival: float, prompt_len: int = 3, max_tokens: int = 2, request_id: int = -1) -> RequestSpec:
    return RequestSpec(request_id=request_id, arrival_s=arrival, prompt_tokens=[1] * prompt_len,
                       sampling=greedy_sampling(max_tokens))


def test_sort_and_number_orders_by_arrival_keeping_ties_in_input_order():
    specs = [spec(2.0, request_id=10), spec(0.5, request_id=11), spec(2.0, request_id=12), spec(0.0, request_id=13)]
    tags = {id(s): s.request_id for s in specs}
    ordered = sort_and_number(specs)
    assert [s.request_id for s in ordered] == [0, 1, 2, 3]
    assert [tags[id(s)] for s in ordered] == [13, 11, 10, 12]


def test_length_summary_reports_means_maxima_and_duration():
    assert length_summary([]) == {"num_requests": 0}
    summary = length_summary([spec(1.0, 4, 10), spec(2.5, 9, 2), spec(4.0, 5, 3)])
    assert summary == {"num_requests": 3, "duration_s": 3.0, "mean_prompt_len": 6.0, "longest_prompt_len": 9,
                       "mean_output_len": 5.0, "longest_output_len": 10}


def test_a_request_line_carries_the_grammar_only_when_there_is_one():
    line = spec(0.25, 2, 4, request_id=3).to_json()
    assert "grammar" not in line and line["seed"] is None and line["prompt_tokens"] == [1, 1]
    constrained = spec(0.25)
    constrained.grammar = {"kind": "regex", "value": "a+"}
    assert constrained.to_json()["grammar"] == {"kind": "regex", "value": "a+"}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**20), rate=st.floats(0.1, 100), cv=st.floats(0.2, 4))
def test_arrival_gaps_are_positive_with_the_asked_mean(seed, rate, cv):
    for arrival in ("poisson", "gamma"):
        gaps = arrival_gaps(random.Random(seed), 400, rate, arrival, cv)
        assert all(g >= 0 and math.isfinite(g) for g in gaps)
        assert 0.5 / rate < sum(gaps) / len(gaps) < 2.0 / rate


def test_burstier_gaps_spread_wider():
    def cv_of(cv: float) -> float:
        gaps = arrival_gaps(random.Random(5), 4000, 10.0, "gamma", cv)
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv_of(0.5) < 0.7 < cv_of(1.0) < 1.3 < cv_of(3.0)


def test_every_builtin_grammar_is_a_valid_spec_and_draws_cover_every_kind():
    for grammar in builtin_grammars():
        assert GrammarSpec.parse(grammar).kind == grammar["kind"]
    rng = random.Random(0)
    kinds = [draw_grammar(rng)["kind"] for _ in range(400)]
    assert set(kinds) == {"json_schema", "regex", "choice"}
    assert kinds.count("json_schema") > kinds.count("regex"), "schemas are drawn twice as often"


def test_grammar_requests_get_room_to_finish_and_the_others_keep_their_draws():
    plain = SyntheticWorkload(vocab_size=64, num_requests=40, seed=2).requests()
    mixed = SyntheticWorkload(vocab_size=64, num_requests=40, seed=2, grammar_share=0.5).requests()
    constrained = [s for s in mixed if s.grammar is not None]
    assert 5 < len(constrained) < 35
    assert all(s.max_tokens == GRAMMAR_MAX_TOKENS and s.sampling["min_tokens"] == 0 for s in constrained)
    for before, after in zip(plain, mixed):
        assert before.arrival_s == after.arrival_s and before.prompt_tokens == after.prompt_tokens
        if after.grammar is None:
            assert before.sampling == after.sampling


def test_multiturn_turns_are_engine_valid_and_prefix_each_other():
    workload = MultiTurnWorkload(vocab_size=50, num_conversations=3, num_turns=3, seed=4, greedy_fraction=0.5)
    by_conversation: dict[int, list[RequestSpec]] = {}
    for request in workload:
        SamplingParams.from_dict(request.sampling).validate(vocab_size=50)
        by_conversation.setdefault(request.conversation_id, []).append(request)
    assert sorted(by_conversation) == [0, 1, 2]
    for turns in by_conversation.values():
        turns.sort(key=lambda s: s.turn)
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt_tokens[:earlier.prompt_len] == earlier.prompt_tokens
            assert later.arrival_s >= earlier.arrival_s
