"""End to end through the official ``openai`` client on the shipped ``tiny-chat``: a thinking chat whose
thought ends on its own (the model writes ``</think>``), then an answer held to a JSON schema that validates."""
from __future__ import annotations

import json

import jsonschema
import pytest
from api_server_helpers import serving
from serve_process import wait_for

from engine.workload.grammars import SCHEMAS

PERSON = SCHEMAS[0]   # {"name": string <= 8, "age": integer 0..120}, both required
THINK_END = 258


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("tiny-chat-run"), "--model", "tiny-chat", "--kv-blocks", "128",
                 "--ssm-slots", "4") as server:
        yield server


def test_a_thought_that_ends_on_its_own_then_a_json_schema_answer(chat_server):
    reply = chat_server.client().chat.completions.create(
        model="tiny-chat", max_tokens=256, temperature=0,
        messages=[{"role": "user", "content": "Give the name and age of Grace, who is 41, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = reply.choices[0]
    reasoning = choice.message.reasoning_content
    assert reasoning and "</think>" not in reasoning, reasoning
    answer = json.loads(choice.message.content)
    jsonschema.validate(answer, PERSON)
    assert choice.finish_reason == "stop"   # the answer closed before max_tokens
    row = wait_for(lambda: chat_server.rows("SELECT output_tokens, grammar, grammar_valid FROM requests WHERE status = 'finished' "
                                            "ORDER BY request_id DESC LIMIT 1"), "the request's row")[0]
    output = json.loads(row["output_tokens"])
    # The model sampled </think> itself (nothing forces it: the grammar only starts after it), well
    # before the budget ran out, and the constrained answer came after it.
    assert output.count(THINK_END) == 1 and output.index(THINK_END) < 200
    assert json.loads(row["grammar"])["after_think"] is True and row["grammar_valid"] == 1
    assert reply.usage.completion_tokens == len(output)


def test_a_required_tool_call_on_tiny_chat_parses_and_validates(chat_server):
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    reply = chat_server.client().chat.completions.create(
        model="tiny-chat", max_tokens=96, temperature=0, tools=tools, tool_choice="required",
        messages=[{"role": "user", "content": "What time is it in Lima?"}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
