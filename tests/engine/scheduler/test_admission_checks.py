"""The admission checks and the stop rules as pure functions: which prompts, sampling and features a
request may carry (hypothesis against a plain statement of the rules), how a rejected request is kept,
and when a sampled token ends the output."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from engine.scheduler.adaptive import StructureTokens
from engine.scheduler.admission import (RequestRejected, check_features, check_prompt, mark_rejected,
                                        parse_sampling, rejected_request, whole_prompt_refusal)
from engine.scheduler.context import ModelTraits
from engine.scheduler.json_fields import strict_kwargs
from engine.scheduler.outputs import finish_reason
from engine.scheduler.request import Request
from engine.scheduler.request_features import RequestFeatures
from engine.scheduler.sampling import SamplingParams
from telemetry import events as ev


def traits(*, detokenize=None, tool_call_start_id=None) -> ModelTraits:
    return ModelTraits(eos_ids=frozenset({0}), max_context=64, vocab_size=100, block_size=4, is_mla=False,
                       is_ep=False, has_linear_attention=True, structure_tokens=StructureTokens(None, None, None),
                       think_end_id=None, tool_call_start_id=tool_call_start_id,
                       prefill_tail_split=lambda prompt: None, detokenize=detokenize)


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(-3, 110), max_size=70), max_tokens=st.integers(1, 80),
       usable=st.integers(1, 40))
def test_a_prompt_is_admitted_exactly_when_it_fits(prompt, max_tokens, usable):
    fits = (bool(prompt) and all(0 <= t < 100 for t in prompt) and len(prompt) < 64
            and -(-(len(prompt) + max_tokens) // 4) <= usable)
    try:
        tokens = check_prompt(prompt, vocab_size=100, max_context=64, num_usable_blocks=usable, block_size=4,
                              max_tokens=max_tokens)
    except RequestRejected as exc:
        assert not fits
        assert str(exc).startswith("prompt_tokens")
    else:
        assert fits and tokens == prompt


def test_prompt_refusals_name_the_first_bad_token_and_the_size():
    kwargs = dict(vocab_size=100, max_context=64, num_usable_blocks=10, block_size=4, max_tokens=4)
    assert check_prompt([1.0, 2], **kwargs) == [1, 2], "a whole float from JSON is an id"
    for prompt, words in [([], "empty prompt"), ([1, True], "prompt_tokens[1]: True is not an integer"),
                          ([1.5], "prompt_tokens[0]: 1.5 is not an integer"),
                          ([float("nan")], "nan is not an integer"), (["7"], "'7' is not an integer"),
                          ([5, 100], "prompt_tokens[1]: token id 100 is outside the vocabulary [0, 100)"),
                          ([1] * 64, "64 tokens do not fit the model's context of 64"),
                          ([1] * 37, "37 prompt + 4 max_tokens need 11 KV blocks, more than the whole cache "
                                     "(10 blocks of 4 tokens)")]:
        with pytest.raises(RequestRejected, match=re.escape(words)):
            check_prompt(prompt, **kwargs)


def test_the_whole_prompt_rule_refuses_only_prompts_over_the_tick_budget():
    assert whole_prompt_refusal(512, 512) is None
    assert "513 tokens exceed the tick's token budget (max_tick_tokens = 512)" in whole_prompt_refusal(513, 512)


def test_sampling_is_parsed_strictly_into_a_rejection():
    assert parse_sampling({"temperature": 0.0, "max_tokens": 3}, 100).max_tokens == 3
    params = SamplingParams(max_tokens=2)
    assert parse_sampling(params, 100) is params
    for raw, words in [({"temprature": 1.0}, "unknown field"), ({"top_p": 0.0}, "sampling.top_p"),
                       ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
                       ({"temperature": "hot"}, "sampling.temperature")]:
        with pytest.raises(RequestRejected, match=words):
            parse_sampling(raw, 100)


def test_features_must_be_ones_the_model_can_honour():
    assert check_features(None, traits()) == RequestFeatures()
    with pytest.raises(RequestRejected, match="features.stop_strings: the checkpoint has no tokenizer"):
        check_features({"stop_strings": ["END"]}, traits())
    assert check_features({"stop_strings": ["END"]}, traits(detokenize=str)).stop_strings == ("END",)
    with pytest.raises(RequestRejected, match="features.require_tool_call: the model has no tool-call start"):
        check_features(RequestFeatures(require_tool_call=True), traits())
    assert check_features({"require_tool_call": True}, traits(tool_call_start_id=7)).require_tool_call
    with pytest.raises(RequestRejected, match="features.source"):
        check_features({"source": "carrier pigeon"}, traits())
    with pytest.raises(RequestRejected, match="unknown field"):
        check_features({"thinking": True}, traits())


def test_a_rejected_request_keeps_what_the_client_sent():
    request = rejected_request(9, [1, "x", 3], {"temperature": -1}, {"source": "api", "bogus": 1},
                               {"kind": "regex", "value": "a+", "after_think": 1}, vocab_size=100, now_ns=55,
                               tick=4, conversation_id=2)
    mark_rejected(request, "sampling.temperature must be a number >= 0")
    assert request.prompt_tokens == [1, 3] and request.sampling_record == {"temperature": -1}
    assert request.features_record == {"source": "api", "bogus": 1}
    assert (request.grammar_spec.kind, request.grammar_spec.value, request.grammar_spec.after_think) == \
        ("regex", "a+", True)
    assert (request.status, request.finish_reason, request.finished_ns) == (ev.REQ_REJECTED, "error", 55)
    assert (request.arrival_tick, request.conversation_id) == (4, 2)
    odd = rejected_request(1, "not a list", None, RequestFeatures(source="api"), None, vocab_size=100, now_ns=0,
                           tick=0, conversation_id=None)
    assert odd.prompt_tokens == [] and odd.sampling_record == {} and odd.features.source == "api"


def request_with(output: list[int], prompt_len: int = 3, **sampling) -> Request:
    request = Request(0, [1] * prompt_len, SamplingParams(**sampling), 0, 0)
    request.output_tokens = list(output)
    return request


def test_finish_reasons_in_their_order():
    eos = frozenset({0})
    assert finish_reason(request_with([5, 0], max_tokens=8), 0, eos, 64) == "eos"
    assert finish_reason(request_with([0], max_tokens=8, min_tokens=2), 0, eos, 64) is None, \
        "EOS before min_tokens does not end the output"
    assert finish_reason(request_with([5, 7], max_tokens=8, stop_token_ids=(7,)), 7, eos, 64) == "stop"
    assert finish_reason(request_with([7], max_tokens=8, min_tokens=3, stop_token_ids=(7,)), 7, eos, 64) is None
    assert finish_reason(request_with([5, 6], max_tokens=2), 6, eos, 64) == "length"
    assert finish_reason(request_with([0, 0], max_tokens=2, min_tokens=2), 0, eos, 64) == "eos", \
        "EOS on the last allowed token reads as eos"
    assert finish_reason(request_with([5], prompt_len=63, max_tokens=8), 5, eos, 64) == "length", "the context"
    assert finish_reason(request_with([5], max_tokens=8), 5, eos, 64) is None


def test_strict_kwargs_refuses_typos_and_non_lists():
    assert strict_kwargs(SamplingParams, {"max_tokens": 2, "stop_token_ids": [3]}, "sampling", "stop_token_ids",
                         "ints") == {"max_tokens": 2, "stop_token_ids": (3,)}
    with pytest.raises(ValueError, match="sampling must be a JSON object, got list"):
        strict_kwargs(SamplingParams, [1], "sampling", "stop_token_ids", "ints")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['mx_tokens'\]"):
        strict_kwargs(SamplingParams, {"mx_tokens": 2}, "sampling", "stop_token_ids", "ints")
