"""The cases a vLLM user hits (issue 31), ported in our words against a real server: parameters that act
or are refused with a 400 naming them, n > 1 with per-choice seeds, echo with logprobs, lists of prompts,
logprobs that are always JSON numbers with exact bytes, custom roles, tools without parameters.

The tiny model's vocabulary is the 256 bytes (token id = byte value) plus special tokens, so a
character like "é" is two tokens and "Z" is token 90."""
from __future__ import annotations

import json

import httpx
import pytest

from api_server_helpers import serving
from serve_process import wait_for

PROMPT_IDS = list(b"The quick brown fox jumps over the lazy dog.")     # 44 tokens: 2 full blocks of 16
GREEDY = {"model": "tiny", "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Room for n = 4 (the shared server queues 3 at most), and the prefix cache on (serve's default)."""
    with serving(tmp_path_factory.mktemp("vllm-cases"), "--ssm-slots", "4", "--kv-blocks", "128",
                 "--max-waiting", "32") as srv:
        yield srv


def post(server, path: str, body: dict, client: httpx.Client | None = None) -> httpx.Response:
    return (client or httpx).post(f"{server.url}/v1/{path}", json=body, timeout=120)


def completion(server, **body) -> dict:
    response = post(server, "completions", {**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as JavaScript, Go and Rust parsers do."""
    def refuse(literal):
        raise ValueError(f"non-JSON literal {literal}")
    return json.loads(text, parse_constant=refuse)


def sse_chunks(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [strict_json(line) for line in lines[:-1]]


# ---- parameters that act ----------------------------------------------------------------------------
def test_logit_bias_plus_100_takes_greedy_output(server):
    plain = completion(server, prompt=PROMPT_IDS, max_tokens=6, min_tokens=6)["choices"][0]["text"]
    biased = completion(server, prompt=PROMPT_IDS, max_tokens=6, min_tokens=6,
                        logit_bias={"90": 100})["choices"][0]["text"]
    assert biased == "ZZZZZZ" != plain
    banned = completion(server, prompt=PROMPT_IDS, max_tokens=6, min_tokens=6,
                        logit_bias={str(b): -100 for b in plain.encode()[:1]})["choices"][0]["text"]
    assert banned[:1] != plain[:1]


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_change_greedy_repeats(server, penalty):
    body = dict(prompt=PROMPT_IDS, max_tokens=40, min_tokens=40, logprobs=0)
    plain = completion(server, **body)["choices"][0]["logprobs"]["tokens"]
    penalized = completion(server, **body, **{penalty: 2.0})["choices"][0]["logprobs"]["tokens"]
    assert penalized != plain
    # OpenAI's definition subtracts per repeat: the most repeated token repeats less (or no more)
    assert max(penalized.count(t) for t in penalized) <= max(plain.count(t) for t in plain)
    assert len(set(penalized)) > len(set(plain))


# ---- refused with a 400 naming the parameter --------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"99999": 1}}, "logit_bias"),            # not a token id of this vocabulary
    ({"logit_bias": {"abc": 1}}, "logit_bias"),              # not an integer key
    ({"logit_bias": {"5": "x"}}, "logit_bias"),              # not a number
    ({"logit_bias": {"5": 150}}, "logit_bias"),              # outside [-100, 100]
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),   # without stream
    ({"best_of": 3}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"suffix": "tail"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),                       # 0 only with echo
])
def test_invalid_or_unsupported_forms_are_400_naming_the_param(server, extra, param):
    response = post(server, "completions", {**GREEDY, "prompt": "x", "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_neutral_values_of_unsupported_fields_pass(server):
    """Clients that spell out defaults are served."""
    completion(server, prompt="x", max_tokens=2, best_of=1, use_beam_search=False, ignore_eos=False, user="me")


# ---- n > 1 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
def test_n_choices_each_replays_with_seed_plus_index(server, n):
    body = dict(prompt=PROMPT_IDS, max_tokens=8, min_tokens=8, temperature=1.0, seed=11)
    reply = completion(server, n=n, **body)
    texts = [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in reply["choices"]] == list(range(n))
    assert reply["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 8 * n,
                              "total_tokens": len(PROMPT_IDS) + 8 * n}
    for i, text in enumerate(texts):
        alone = completion(server, n=1, **{**body, "seed": 11 + i})["choices"][0]["text"]
        assert text == alone, f"choice {i} does not replay as seed {11 + i}"
    assert len(set(texts)) == n


def test_siblings_hit_the_prefix_cache(server):
    prompt = list(b"Siblings share this prompt's first two blocks!!")   # 47 tokens, tail boundary 32
    completion(server, prompt=prompt, n=3, max_tokens=4, temperature=1.0, seed=3)

    def finished_rows():
        rows = server.rows("SELECT status, prefix_hit_tokens, features FROM requests WHERE prompt_tokens = ? "
                           "ORDER BY request_id", (json.dumps(prompt, separators=(",", ":")),))
        return rows if len(rows) == 3 and all(r["status"] == "finished" for r in rows) else None

    rows = wait_for(finished_rows, "the siblings' rows")
    assert [json.loads(r["features"]).get("choice", 0) for r in rows] == [0, 1, 2]   # 0 is not stored
    assert [r["prefix_hit_tokens"] for r in rows] == [0, 32, 32]


def test_chat_n_streamed_carries_each_index_and_summed_usage(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 3,
            "temperature": 1.0, "seed": 5, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(post(server, "chat/completions", body))
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert sorted(finished) == [0, 1, 2]
    usage = chunks[-1]["usage"]
    whole = post(server, "chat/completions", {**body, "stream": False, "stream_options": None}).json()
    assert usage == whole["usage"] and whole["usage"]["completion_tokens"] <= 15
    assert len(whole["choices"]) == 3


def test_a_list_of_prompts_times_n(server):
    reply = completion(server, prompt=["Ab", "Cde"], n=2, max_tokens=3, min_tokens=3, temperature=1.0, seed=1)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert reply["usage"]["prompt_tokens"] == 2 + 3 and reply["usage"]["completion_tokens"] == 12
    first = completion(server, prompt="Ab", n=2, max_tokens=3, min_tokens=3, temperature=1.0, seed=1)
    assert [c["text"] for c in reply["choices"][:2]] == [c["text"] for c in first["choices"]]


# ---- echo and logprobs ----------------------------------------------------------------------------------
def test_echo_with_logprobs_scores_the_prompt(server):
    prompt = "Hello world"
    reply = completion(server, prompt=prompt, echo=True, logprobs=2, max_tokens=3, min_tokens=3)["choices"][0]
    lp = reply["logprobs"]
    assert reply["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(prompt) + 3 and lp["tokens"][:len(prompt)] == list(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == list(range(len(prompt) + 3))
    alone = completion(server, prompt=prompt, echo=True, logprobs=2, max_tokens=0)["choices"][0]
    assert alone["text"] == prompt and len(alone["logprobs"]["tokens"]) == len(prompt)
    # The logprob of prompt token i is what the model gives it after the tokens before it: the same
    # number a request for that prefix reports when token i is forced (raw logprobs ignore the bias).
    # bf16 rounds a 3-token and an 11-token prefill differently, hence the tolerance.
    for i in (3, 7):
        forced = completion(server, prompt=prompt[:i], max_tokens=1, logprobs=0,
                            logit_bias={str(ord(prompt[i])): 100})["choices"][0]["logprobs"]["token_logprobs"][0]
        assert alone["logprobs"]["token_logprobs"][i] == pytest.approx(forced, abs=0.05)


def test_echo_streamed_equals_whole(server):
    body = dict(prompt="Echo me", echo=True, logprobs=1, max_tokens=4, min_tokens=4)
    whole = completion(server, **body)["choices"][0]
    chunks = sse_chunks(post(server, "completions", {**GREEDY, **body, "stream": True}))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint", [{"structured_outputs": {"choice": ["yes", "no"]}},
                                        {"response_format": {"type": "json_object"}}])
def test_masked_logprobs_are_minus_9999_never_a_500(server, stream, constraint):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 12, "logprobs": True,
            "top_logprobs": 5, "temperature": 0, "stream": stream, **constraint}
    with httpx.Client(timeout=120) as client:      # one pooled connection: the next request must work too
        response = post(server, "chat/completions", body, client)
        assert response.status_code == 200, response.text
        if stream:
            content = [e for c in sse_chunks(response) if c["choices"] and c["choices"][0]["logprobs"]
                       for e in c["choices"][0]["logprobs"]["content"]]
        else:
            content = strict_json(response.text)["choices"][0]["logprobs"]["content"]
        assert content and all(len(e["top_logprobs"]) == 5 for e in content)
        values = [t["logprob"] for e in content for t in e["top_logprobs"]]
        assert -9999.0 in values and all(v == -9999.0 or -9999.0 < v <= 0 for v in values)
        assert post(server, "completions", {**GREEDY, "prompt": "x", "max_tokens": 1}, client).status_code == 200


def test_bytes_rebuild_multibyte_text_and_equal_texts_do_not_collapse(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "say it"}], "max_tokens": 8,
            "logprobs": True, "top_logprobs": 4, "temperature": 0,
            "structured_outputs": {"choice": ["é€ok"]}}
    reply = post(server, "chat/completions", body).json()["choices"][0]
    content = reply["logprobs"]["content"]
    assert reply["message"]["content"] == "é€ok"
    assert bytes(b for e in content for b in e["bytes"]) == "é€ok".encode()
    assert content[0]["token"] == "bytes:\\xc3" and content[0]["bytes"] == [0xC3]
    for entry in content:
        names = [t["token"] for t in entry["top_logprobs"]]
        assert len(set(names)) == len(names) == 4
    legacy = completion(server, prompt="say it", max_tokens=2, logprobs=5, min_tokens=2)["choices"][0]["logprobs"]
    assert all(len(top) == 5 for top in legacy["top_logprobs"])     # one entry per id, none merged


# ---- chat forms ------------------------------------------------------------------------------------------
def test_custom_roles_reach_the_template(server):
    body = {"model": "tiny", "messages": [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Go"}],
            "max_tokens": 2, "temperature": 0}
    assert post(server, "chat/completions", body).status_code == 200
    rows = wait_for(lambda: server.rows("SELECT prompt_tokens FROM requests WHERE prompt_tokens LIKE ?",
                                        (f"%{','.join(map(str, b'narrator'))}%",)), "the narrator's row")
    assert bytes(t for t in json.loads(rows[0]["prompt_tokens"]) if t < 256).count(b"narrator\nOnce") == 1


def test_a_tool_without_parameters_gets_empty_arguments(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}], "max_tokens": 60,
            "temperature": 1.0, "seed": 2, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "now"}}]}
    reply = post(server, "chat/completions", body).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls", reply
    assert json.loads(reply["message"]["tool_calls"][0]["function"]["arguments"]) == {}


def test_structured_outputs_json_is_vllms_form(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"json": schema}}
    reply = post(server, "chat/completions", body).json()["choices"][0]
    assert json.loads(reply["message"]["content"]) in ({"ok": True}, {"ok": False})
