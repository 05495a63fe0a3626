"""The committed set of real-world schemas (tests/fixtures/schemastore, Apache-2.0, see its NOTICE.md)
through the API: lenient by default, each is accepted with an output that validates against the schema
less the keywords the server reported ignoring, or refused with a 400 naming the keyword; strict mode
refuses what it refused before lenient compiles existed."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from api_server_helpers import started_server
from serve_process import stop

from engine.grammar.schema_walk import subschemas

SCHEMAS = sorted((Path(__file__).resolve().parents[2] / "fixtures" / "schemastore").glob("*.json"))
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = started_server(tmp_path_factory.mktemp("schema-set"), "--ssm-slots", "2", "--kv-blocks", "128")
    yield srv
    stop(srv.proc)


def relaxed(schema: dict, ignored: list[str]) -> dict:
    """``schema`` without the keywords the server said it ignored (``format:X``: that format;
    ``oneOf``: read as ``anyOf``, which is what was enforced)."""
    out = copy.deepcopy(schema)
    for sub in list(subschemas(out)):
        for keyword in ignored:
            if keyword.startswith("format:"):
                if sub.get("format") == keyword.split(":", 1)[1]:
                    del sub["format"]
            elif keyword == "oneOf" and "oneOf" in sub:
                sub["anyOf"] = sub.pop("oneOf")
            else:
                sub.pop(keyword, None)
        if isinstance(sub.get("pattern"), str):   # Python's re spells a named group (?P<name>...)
            sub["pattern"] = sub["pattern"].replace("(?<", "(?P<").replace("(?P<=", "(?<=").replace("(?P<!", "(?<!")
    return out


def ask(server, schema: dict, max_tokens: int = MAX_TOKENS, **outputs) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Write the config."}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": 7,
            "structured_outputs": {"json": schema, "max_string_length": 12, **outputs}}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def test_the_set_is_real_and_licensed():
    assert len(SCHEMAS) >= 30
    notice = (SCHEMAS[0].parent / "NOTICE.md").read_text()
    assert (SCHEMAS[0].parent / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert all(f"src/schemas/json/{p.name}" in notice for p in SCHEMAS)


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.stem)
def test_accepted_with_a_valid_output_or_refused_naming_the_keyword(server, path):
    schema = json.loads(path.read_text())
    response = ask(server, schema)
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["param"] == "structured_outputs" and "[schema keyword: " in error["message"], error
        return
    assert response.status_code == 200, response.text
    reply = response.json()
    ignored = reply.get("grammar_approximations", [])
    assert response.headers.get("x-chunkscope-grammar-approximations", "") == ", ".join(ignored)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", f"{path.stem}: ran to max_tokens: {choice['message']['content'][-200:]!r}"
    checked = relaxed(schema, ignored)
    jsonschema.validators.validator_for(checked)(checked).validate(json.loads(choice["message"]["content"]))


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.stem)
def test_strict_refuses_what_lenient_ignores(server, path):
    schema = json.loads(path.read_text())
    lenient = ask(server, schema, max_tokens=1, strict=False)
    if lenient.status_code != 200 or not lenient.json().get("grammar_approximations"):
        return   # nothing was ignored: strict and lenient agree
    strict = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema,
                                                                    "strict": True}}})
    assert strict.status_code == 400, strict.text
    assert "[schema keyword: " in strict.json()["error"]["message"]
