"""Completions and chat completions through the official openai client against a real server."""
from __future__ import annotations

import json

import pytest
import torch

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.model.tiny import ensure_tiny_checkpoint
from engine.model.tokenizer import load_tokenizer
from engine.cache.sequence import SequenceState

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_tiny_checkpoint())


def stream_text(stream, field="text"):
    """(joined text deltas, finish reasons, usage) of a streamed reply."""
    parts, finish, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.text if field == "text" else getattr(choice.delta, field, None)
            parts.append(text or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(parts), finish, usage


def test_completion_usage_and_stream_equal_whole(api_server, tokenizer):
    client = api_server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"min_tokens": 12})
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    row = api_server.rows("SELECT prompt_len, output_len, source FROM requests ORDER BY request_id DESC LIMIT 1")
    text, finish, usage = stream_text(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"min_tokens": 12}, stream=True,
        stream_options={"include_usage": True}))
    assert text == whole.choices[0].text and finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 12)
    if row:  # the writer flushes every ~100 ms; the usage must equal what the engine stored
        assert row[0]["source"] == "api"


def test_token_id_prompt_and_usage_equal_engine_rows(api_server):
    client = api_server.client()
    reply = client.completions.create(model="tiny", prompt=[72, 101, 108, 108, 111], max_tokens=5, temperature=0)
    from serve_process import wait_for
    rows = wait_for(lambda: api_server.rows(
        "SELECT prompt_len, output_len, prompt_tokens, status FROM requests WHERE status = 'finished' "
        "AND prompt_tokens = '[72,101,108,108,111]'"), "the request row")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (rows[0]["prompt_len"], rows[0]["output_len"])


def test_chat_whole_and_streamed_agree(api_server):
    client = api_server.client()
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    text, finish, usage = stream_text(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}), field="content")
    assert text == (whole.choices[0].message.content or "")
    assert finish == [whole.choices[0].finish_reason] and finish[0] in ("stop", "length")
    assert usage.completion_tokens == whole.usage.completion_tokens >= 1
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_seeded_sampled_request_repeats(api_server):
    client = api_server.client()
    args = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
                extra_body={"top_k": 50})
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first
    other = client.completions.create(**{**args, "seed": 99}).choices[0].text
    assert other != first   # the seed is really used (16 sampled bytes colliding is ~impossible)


def test_stop_string_ends_text(api_server):
    client = api_server.client()
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"min_tokens": 24})
    text = base.choices[0].text
    clean = [i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2] not in text[:i]]
    assert clean, f"no usable stop string in {text!r}"
    stop = text[clean[0]:clean[0] + 2]
    for stream in (False, True):
        if stream:
            got, finish, _ = stream_text(client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True))
        else:
            reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
            got, finish = reply.choices[0].text, [reply.choices[0].finish_reason]
            assert reply.usage.completion_tokens < 24
        assert got == text[:clean[0]] and finish == ["stop"]


def engine_logprobs(prompt: list[int], output: list[int], dtype: str) -> list[torch.Tensor]:
    """log_softmax of the engine's own logits before each output token: prefill, then decodes.

    ``dtype`` is the served run's (``runs.config.dtype``): ``--dtype auto`` is bf16 on a CPU with
    native bf16 multiplies, and the reference must run the forward the server ran.
    """
    model, _, _ = load_model("tiny", dtype=getattr(torch, dtype))
    runner = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=1, dtype=getattr(torch, dtype))
    seq = SequenceState(request_id=0)
    runner.pools.admit(seq)
    rows = [runner.prefill_chunk(seq, prompt, 0, len(prompt), True)]              # [V]
    for token in output[:-1]:
        rows.append(runner.decode([seq], [token])[0])                              # [V]
    return [torch.log_softmax(r.float(), dim=-1) for r in rows]


def test_logprobs_equal_engine_log_softmax(api_server, tokenizer):
    client = api_server.client()
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=5,
                                      logprobs=3, extra_body={"min_tokens": 6})
    lp = reply.choices[0].logprobs
    from serve_process import wait_for
    row = wait_for(lambda: api_server.rows(
        "SELECT output_tokens FROM requests WHERE status='finished' AND features LIKE '%\"logprobs\":3%'"),
        "the logprobs request row")
    output = json.loads(row[-1]["output_tokens"])
    dtype = json.loads(api_server.rows("SELECT config FROM runs")[0]["config"])["dtype"]
    expected = engine_logprobs(tokenizer.encode(PROMPT), output, dtype)
    assert len(lp.token_logprobs) == 6
    for got, token, top, want in zip(lp.token_logprobs, output, lp.top_logprobs, expected):
        assert got == pytest.approx(want[token].item(), abs=1e-4)
        best = torch.topk(want, 3).values.tolist()   # the dict is keyed by text: two ids may share one
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)  # greedy: top 1


def test_chat_without_max_tokens_gets_what_the_cache_leaves(api_server):
    """No max_tokens: accepted (not a 400 for exceeding the cache); the stream is left after one event."""
    stream = api_server.client().chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                                         stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()


def test_models_and_health(api_server):
    assert [m.id for m in api_server.client().models.list().data] == ["tiny"]
