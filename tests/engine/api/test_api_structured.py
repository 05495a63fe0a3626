"""Structured output through the HTTP API (real server, the official openai client and raw httpx):
response_format json_object / json_schema, structured_outputs regex / choice / grammar, tool-call
arguments under tool_choice required, and a grammar that does not compile -> 400 naming it."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "temp": {"type": "integer", "minimum": -40, "maximum": 50}},
          "required": ["city", "temp"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


def chat(server, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 96,
            "temperature": 1.0, "seed": 3, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_response_format_json_schema_and_json_object(api_server):
    client = api_server.client()
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], max_tokens=96, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    response = chat(api_server, response_format={"type": "json_object"}, max_tokens=200)
    assert response.status_code == 200, response.text
    row = api_server.rows("SELECT grammar_kind FROM requests ORDER BY request_id DESC LIMIT 1")[0]
    assert row["grammar_kind"] == "json_object"


@pytest.mark.parametrize("outputs, check", [
    ({"regex": "[a-z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text)),
    ({"choice": ["sunny", "rainy"]}, lambda text: text in ("sunny", "rainy")),
    ({"grammar": 'start: "temp=" /[0-9]{1,2}/ "C"'}, lambda text: re.fullmatch("temp=[0-9]{1,2}C", text)),
])
def test_structured_outputs_regex_choice_grammar(api_server, outputs, check):
    response = chat(api_server, structured_outputs=outputs)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["message"]["content"]), choice


def test_required_tool_call_arguments_follow_the_schema(api_server):
    response = chat(api_server, tools=TOOLS, tool_choice="required")
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    calls = message["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA)


@pytest.mark.parametrize("extra, param, message", [
    ({"structured_outputs": {"regex": "[("}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "give one"),
])
def test_bad_grammars_are_400_naming_the_problem(api_server, extra, param, message):
    response = chat(api_server, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
