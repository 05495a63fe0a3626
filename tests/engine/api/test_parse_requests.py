"""``parse.py`` without a server: an OpenAI body -> the engine requests it becomes (prompt forms, n choices
and their seeds, default max_tokens) and the 400s only the engine's size can decide, each naming its field."""
from __future__ import annotations

import json

import pytest

from engine.api.chat_template import ChatTemplate
from engine.api.errors import APIError
from engine.api.parse import (MAX_BODY_BYTES, EngineInfo, chat_requests, completion_requests, fan_out,
                              logit_bias_pairs, prompts_of, validate)
from engine.api.protocol import ChatCompletionRequest, CompletionRequest
from engine.api.unsupported import CHAT_ONLY, REFUSED, refuse
from engine.model.tokenizer import IM_END, Tokenizer, build_byte_tokenizer

TOKENIZER = Tokenizer(build_byte_tokenizer())


def info(**overrides) -> EngineInfo:
    fields = dict(model_name="tiny", vocab_size=TOKENIZER.vocab_size, max_context=64, num_kv_blocks=8,
                  block_size=4, tokenizer=TOKENIZER, chat_template=ChatTemplate.for_checkpoint(None),
                  has_tool_call_token=False)
    return EngineInfo(**{**fields, **overrides})


def completion(**body):
    return completion_requests(info(), CompletionRequest(**{"model": "tiny", "prompt": "hi", **body}))


def refused(call, param: str, words: str, status: int = 400, code: str | None = None) -> None:
    with pytest.raises(APIError) as caught:
        call()
    err = caught.value
    assert (err.status, err.param) == (status, param), err.message
    assert words in err.message
    if code is not None:
        assert err.code == code


def test_the_four_prompt_forms():
    assert prompts_of("a") == ["a"] and prompts_of([1, 2]) == [[1, 2]]
    assert prompts_of(["a", "b"]) == ["a", "b"] and prompts_of([[1], [2, 3]]) == [[1], [2, 3]]
    requests = completion(prompt=["ab", "c"], n=2, seed=10, echo=True)
    assert [r.index for r in requests] == [0, 1, 2, 3]
    assert [r.prompt_tokens for r in requests] == [[97, 98]] * 2 + [[99]] * 2
    assert [r.sampling["seed"] for r in requests] == [10, 11, 10, 11], "choice i samples with seed + i"
    assert [(r.features.n, r.features.choice) for r in requests] == [(2, 0), (2, 1)] * 2
    assert requests[0].echo == "ab" and requests[2].echo == "c"
    by_ids = completion(prompt=[[5, 6, 7], [8]], echo=True)
    assert [r.prompt_tokens for r in by_ids] == [[5, 6, 7], [8]]
    assert by_ids[0].echo == TOKENIZER.decode([5, 6, 7]), "token prompts echo their decoded text"


def test_fan_out_without_a_seed_leaves_each_choice_its_own():
    one = completion()[0]
    assert [r.sampling["seed"] for r in fan_out(one, 3, first_index=5)] == [None] * 3
    assert [r.index for r in fan_out(one, 3, first_index=5)] == [5, 6, 7]


def test_sampling_maps_every_field_and_sorts_stop_ids():
    request = completion(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, min_tokens=2, max_tokens=6,
                         stop_token_ids=[9, 3, 9], logit_bias={"20": -100, "7": 2.5}, presence_penalty=0.5,
                         repetition_penalty=1.1, stop=["xy"])[0]
    assert request.sampling == {"temperature": 0.5, "top_k": 0, "top_p": 0.9, "min_p": 0.1, "min_tokens": 2,
                                "max_tokens": 6, "seed": None, "stop_token_ids": [3, 9],
                                "logit_bias": [[7, 2.5], [20, -100.0]], "presence_penalty": 0.5,
                                "frequency_penalty": 0.0, "repetition_penalty": 1.1}
    assert request.features.stop_strings == ("xy",) and request.features.source == "api"


def test_an_absent_max_tokens_fills_what_context_and_cache_leave():
    chat = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}])
    request = chat_requests(info(max_context=4096), chat)[0]
    assert request.sampling["max_tokens"] == 8 * 4 - len(request.prompt_tokens), "the whole KV cache"
    request = chat_requests(info(max_context=40, num_kv_blocks=1000), chat)[0]
    assert request.sampling["max_tokens"] == 40 - len(request.prompt_tokens), "the context"
    assert request.sampling["stop_token_ids"] == [TOKENIZER.token_id(IM_END)], "the end of turn stops a chat"


@pytest.mark.parametrize("body, param, words, code", [
    ({"prompt": [1] * 64}, "prompt", "64 tokens do not fit the model's context of 64", "context_length_exceeded"),
    ({"prompt": "abc", "max_tokens": 62}, "max_tokens", "3 prompt + 62 max_tokens exceed", "context_length_exceeded"),
    ({"prompt": "abc", "max_tokens": 30}, "max_tokens", "need 9 KV blocks, more than the whole cache (8 blocks",
     "kv_cache_exceeded"),
    ({"prompt": []}, "prompt", "empty prompt", None),
    ({"prompt": [1, 99999]}, "prompt", "token id 99999 is outside the vocabulary", None),
    ({"max_tokens": 0}, "max_tokens", "only meaningful with echo", None),
    ({"prompt": ["a"] * 17}, "prompt", "at most 16 prompts per request, got 17", None),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens: 9 is more than max_tokens 4", None),
    ({"stop": ["a", ""]}, "stop", "at most 16 non-empty strings", None),
    ({"stop_token_ids": [5, 100000]}, "stop_token_ids", "100000 is outside the vocabulary", None),
    ({"logit_bias": {"x1": 1.0}}, "logit_bias", "'x1' is not a token id", None),
    ({"logit_bias": {"3": 101.0}}, "logit_bias", "the bias of 3 is 101.0, outside [-100, 100]", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true", None),
    ({"best_of": 3}, "best_of", "not supported by this server", "unsupported_parameter"),
])
def test_a_completion_the_engine_cannot_run_is_a_400_naming_the_field(body, param, words, code):
    refused(lambda: completion(**body), param, words, code=code)


def test_a_prompt_that_fills_the_cache_leaves_no_default_output():
    chat = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x" * 40}])
    refused(lambda: chat_requests(info(max_context=4096, num_kv_blocks=2), chat), "prompt",
            "tokens fill the whole KV cache", code="kv_cache_exceeded")


def test_the_wrong_model_is_a_404():
    refused(lambda: completion(model="gpt-4"), "model", "does not exist; this server serves 'tiny'", status=404,
            code="model_not_found")


def chat(engine: EngineInfo | None = None, **body):
    return chat_requests(engine or info(), ChatCompletionRequest(**{"model": "tiny",
                                                          "messages": [{"role": "user", "content": "x"}], **body}))


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "function 'other' is not among tools ['get_weather']"),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs at least one tool"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice", "no tool-call start token to force"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"echo": True}, "echo", "chat echo"),
])
def test_a_chat_the_engine_cannot_run_is_a_400_naming_the_field(body, param, words):
    refused(lambda: chat(**body), param, words)


def test_tool_choice_none_hides_the_tools_and_auto_allows_calls():
    roomy = info(max_context=4096, num_kv_blocks=1024)   # the tools' listing makes a long prompt
    hidden = chat(roomy, tools=[TOOL], tool_choice="none")[0]
    assert hidden.tools_allowed is False and b"get_weather" not in bytes(t for t in hidden.prompt_tokens if t < 256)
    allowed = chat(roomy, tools=[TOOL])[0]
    assert allowed.tools_allowed is True and allowed.features.require_tool_call is False
    assert b"get_weather" in bytes(t for t in allowed.prompt_tokens if t < 256), "the template lists the tool"


def test_validate_names_the_field_and_bounds_the_body():
    refused(lambda: validate(CompletionRequest, b'{"model": "tiny", "prompt": "a", "max_tokens": "10"}'),
            "max_tokens", "max_tokens:")
    refused(lambda: validate(CompletionRequest, b'{"model": '), None, "malformed JSON body", code="invalid_json")
    refused(lambda: validate(CompletionRequest, b" " * (MAX_BODY_BYTES + 1)), None, "more than", status=413,
            code="body_too_large")
    body = validate(CompletionRequest, json.dumps({"model": "tiny", "prompt": "a", "user": "me"}).encode())
    assert body.model_extra == {"user": "me"}, "unknown fields are kept, not refused"


def test_every_refused_field_passes_its_off_values_and_refuses_the_rest():
    for name, (off, _instead) in {**REFUSED, **CHAT_ONLY}.items():
        for value in off:
            refuse({name: value}, chat=True)
        with pytest.raises(APIError) as caught:
            refuse({name: "on"}, chat=True)
        assert caught.value.param == name and caught.value.code == "unsupported_parameter"
    refuse({"echo": True, "user": "x"}, chat=False)   # echo is honoured on completions


def test_logit_bias_pairs_are_sorted_by_token():
    assert logit_bias_pairs(info(), None) == []
    assert logit_bias_pairs(info(), {"10": 1, "2": -3.5}) == [[2, -3.5], [10, 1.0]]


def test_an_image_for_a_text_only_model_is_a_400_and_the_image_bytes_ride_with_the_request():
    import base64

    from engine.model.tokenizer import IMAGE_PAD, VISION_END, VISION_START, VISION_TOKENS
    from engine.multimodal.limits import ImageLimits, ImagePolicy, ImageSettings, content_hash
    from tests.engine.model.vision_checkpoints import png_bytes

    data = png_bytes(20, 40, 0)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]
    refused(lambda: chat(messages=messages), "messages", "this model takes no images")
    tokenizer = Tokenizer(build_byte_tokenizer(VISION_TOKENS))
    policy = ImagePolicy(ImageSettings(8, 2, 2, min_pixels=256, max_pixels=4096), ImageLimits(), VISION_START,
                         IMAGE_PAD, VISION_END, pad_id=tokenizer.token_id(IMAGE_PAD))
    vision = info(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, max_context=256, num_kv_blocks=64,
                  images=policy)
    (request,) = chat(vision, messages=messages)
    assert request.images == (data,) and request.features.images == (content_hash(data),)
    assert request.prompt_tokens.count(policy.pad_id) == 2   # resized to 16 x 32 pixels: 1 x 2 rows of 16 px
    own = [{"role": "user", "content": [part, {"type": "text", "text": IMAGE_PAD}]}]
    refused(lambda: chat(vision, messages=own), "messages", "placeholder tokens of its own")
