"""The grammar of a required (or named) tool call: ``<tool_call>`` JSON ``</tool_call>``.

Qwen's tool-call format is the tool-call start token, a newline, one JSON object
``{"name": ..., "arguments": {...}}``, a newline and the tool-call end token. With
``tool_choice`` required the call may name any of the request's tools, each with its own
``parameters`` schema; with a named tool_choice only that one. A function with no
``parameters`` takes none (OpenAI's reading): its arguments are ``{}``. The result is a Lark
grammar (the special tokens by id, the JSON through llguidance's ``%json``), compact like every
JSON grammar here, and lenient when asked (``spec.py``; the API asks unless a tool is strict). The first-token policy forces
token 0 to the tool-call start; the grammar takes it as its first token.
"""
from __future__ import annotations

import json
from typing import Any

from engine.grammar.spec import KIND_LARK, GrammarSpec, GrammarSpecError

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
LENIENT = {"lenient": True, "coerce_one_of": True}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(tools: list[dict[str, Any]], name: str | None = None, lenient: bool = False) -> dict[str, Any]:
    """The JSON schema of one call: ``{"name": <a tool's name>, "arguments": <its parameters>}``.

    ``tools`` are OpenAI tool entries (``{"type": "function", "function": {"name", "parameters"}}``)
    or bare function objects; ``name`` keeps only that tool (a named tool_choice).
    """
    functions = [t.get("function", t) if isinstance(t, dict) else None for t in tools]
    if not functions or any(not isinstance(f, dict) or not isinstance(f.get("name"), str) for f in functions):
        raise GrammarSpecError("tools: each tool needs a function with a string name")
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise GrammarSpecError(f"tool_choice names {name!r}, which is not among the request's tools")
    options = []
    for function in functions:
        parameters = function.get("parameters")
        parameters = NO_ARGUMENTS if parameters is None else parameters or {"type": "object"}
        if not isinstance(parameters, dict):
            raise GrammarSpecError(f"tools: {function['name']}.parameters must be a JSON schema object")
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {**COMPACT, **LENIENT} if lenient else COMPACT}


def tool_call_spec(tools: list[dict[str, Any]], *, start_id: int, end_id: int, name: str | None = None,
                   after_think: bool = False, lenient: bool = False) -> GrammarSpec:
    """A Lark grammar for exactly one tool call among ``tools`` (or the ``name``d one)."""
    schema = call_schema(tools, name, lenient)
    lark = (f'start: <[{int(start_id)}]> "\\n" call "\\n" <[{int(end_id)}]>\n'
            f"call: %json {json.dumps(schema, separators=(',', ':'))}\n")
    return GrammarSpec.parse({"kind": KIND_LARK, "value": lark, "after_think": after_think, "lenient": lenient})
