"""Thinking and tool calls: the request's features drive the first-token policy, rows record the rules."""
from __future__ import annotations

import json

from serve_process import wait_for

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
THINK_END, TOOL_CALL_START = 258, 259


def latest_row(server, where: str) -> dict:
    return wait_for(lambda: server.rows(f"SELECT * FROM requests WHERE status = 'finished' AND {where} "
                                        "ORDER BY request_id DESC LIMIT 1"), f"a finished request row where {where}")[0]


def test_thinking_returns_reasoning_and_row_shows_rule(api_server):
    reply = api_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Think first."}], max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = reply.choices[0].message
    assert message.reasoning_content   # the tiny model never closes its thought: all of it is reasoning
    row = latest_row(api_server, "first_token_rules LIKE '%thinking%'")
    assert json.loads(row["features"])["enable_thinking"] is True and row["source"] == "api"
    output = json.loads(row["output_tokens"])
    assert output[0] != THINK_END
    chunk = wait_for(lambda: api_server.rows(
        "SELECT first_token_rules FROM chunks WHERE request_id = ? AND is_last = 1", (row["request_id"],)),
        "the last chunk row")
    assert chunk[0]["first_token_rules"] == "thinking"
    streamed = api_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Think first."}], max_tokens=12, temperature=0,
        stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content


def test_required_tool_choice_forces_tool_call_start(api_server):
    reply = api_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice="required", max_tokens=16, temperature=0)
    row = latest_row(api_server, "first_token_rules = 'force_tool_call'")
    assert json.loads(row["output_tokens"])[0] == TOOL_CALL_START
    choice = reply.choices[0]
    # The random tiny model writes no valid call after the forced start: the reply says so.
    extra = choice.model_extra or {}
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.finish_reason in ("stop", "length") and extra.get("tool_call_parse_errors")
        assert choice.message.content.startswith("<tool_call>")


def test_named_tool_choice_and_unknown_name(api_server):
    client = api_server.client()
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=4, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    row = latest_row(api_server, "first_token_rules = 'force_tool_call'")
    assert json.loads(row["features"])["require_tool_call"] is True
    import openai
    import pytest
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"


def test_tool_result_messages_render(api_server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = api_server.client().chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                        max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1
