"""Logit bias and penalties (engine/scheduler/logit_adjust.py) through sample_next: OpenAI's definitions."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.scheduler.sampling import SamplingParams, make_generator, sample_next

V = 16


def greedy(logits, params, output=None, prompt=None):
    b = logits.shape[0]
    return sample_next(logits, params, [None] * b, [0] * b, set(), output_tokens=output,
                       prompt_tokens=prompt).tolist()


def test_logit_bias_moves_greedy_and_bans():
    logits = torch.arange(V, dtype=torch.float32).unsqueeze(0)              # argmax = V - 1
    assert greedy(logits, [SamplingParams()]) == [V - 1]
    assert greedy(logits, [SamplingParams(logit_bias=((3, 100.0),))]) == [3]
    assert greedy(logits, [SamplingParams(logit_bias=((V - 1, -100.0),))]) == [V - 2]


def test_bias_never_revives_a_masked_token():
    logits = torch.zeros(1, V)
    logits[0, 5] = float("-inf")
    logits[0, 7] = 1.0
    assert greedy(logits, [SamplingParams(logit_bias=((5, 100.0),))]) == [7]


def test_frequency_and_presence_penalties_follow_openai():
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 4] = 3.0, 2.0
    # token 2 generated twice: 3 - 2 * 1.0 = 1 < 2, so 4 wins; presence 1.5 alone: 3 - 1.5 = 1.5 < 2
    assert greedy(logits, [SamplingParams(frequency_penalty=1.0)], output=[[2, 2]]) == [4]
    assert greedy(logits, [SamplingParams(frequency_penalty=1.0)], output=[[2]]) == [2]     # 3 - 1 = 2 ties
    assert greedy(logits, [SamplingParams(presence_penalty=1.5)], output=[[2]]) == [4]
    # penalties count generated tokens only: the prompt does not count
    assert greedy(logits, [SamplingParams(presence_penalty=1.5)], output=[[]], prompt=[[2]]) == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.zeros(1, V) - 1.0
    logits[0, 2], logits[0, 4] = 3.0, 2.0
    assert greedy(logits, [SamplingParams(repetition_penalty=2.0)], prompt=[[2]]) == [4]   # 3 / 2 < 2
    assert greedy(logits, [SamplingParams(repetition_penalty=2.0)], output=[[4]], prompt=[[2]]) == [2]  # 1.5 vs 1


def test_rows_without_adjustments_are_untouched_and_rows_are_independent():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    plain = greedy(logits.clone(), [SamplingParams()] * 3)
    mixed = greedy(logits.clone(), [SamplingParams(), SamplingParams(logit_bias=((0, 100.0),)), SamplingParams()])
    assert mixed[0] == plain[0] and mixed[2] == plain[2] and mixed[1] == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), token=st.integers(0, V - 1))
def test_a_plus_100_bias_forces_the_token_even_when_sampled(seed, token):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=1.0, seed=seed, logit_bias=((token, 100.0),))
    out = sample_next(logits, [params], [make_generator(seed)], [0], set())
    assert out.tolist() == [token]


@pytest.mark.parametrize("field, value, message", [
    ("logit_bias", ((V, 1.0),), "outside the vocabulary"),
    ("logit_bias", ((1, 101.0),), "logit_bias[1]"),
    ("logit_bias", (("1", 1.0),), "outside the vocabulary"),
    ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", float("nan"), "presence_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
])
def test_validate_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value}).validate(V)


def test_round_trip_through_a_stored_dict():
    params = SamplingParams(logit_bias=((3, -2.5), (7, 1.0)), presence_penalty=0.5, frequency_penalty=-0.25,
                            repetition_penalty=1.1)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams.from_dict({"temperature": 0.0}).logit_bias == ()
