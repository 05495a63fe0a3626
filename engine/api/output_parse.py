"""A chat reply's text -> reasoning, answer and tool calls, in Qwen3.5's conventions.

- The thought is everything before ``</think>`` (an opening ``<think>`` is dropped); with
  thinking on and no ``</think>`` yet, all of the text is thought.
- Tool calls sit in ``<tool_call>...</tool_call>`` blocks, in the XML form
  (``<function=NAME><parameter=P>value</parameter></function>``) or the older JSON form
  (``{"name": ..., "arguments": {...}}``). A block that parses becomes an OpenAI tool call
  with JSON ``arguments``; one that does not is reported, with why, and left in the text.
Pure functions over strings, tested without a model.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


@dataclass
class ParsedReply:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(thought, the rest) of a reply."""
    if THINK_END in text:
        thought, rest = text.split(THINK_END, 1)
        return thought.removeprefix(THINK_START).strip("\n"), rest.lstrip("\n")
    if thinking:
        return text.removeprefix(THINK_START).strip("\n"), ""
    return None, text


def parse_reply(text: str, *, thinking: bool, tools_allowed: bool) -> ParsedReply:
    reasoning, rest = split_reasoning(text, thinking)
    if not tools_allowed or TOOL_START not in rest:
        return ParsedReply(reasoning, rest or None)
    head, calls, errors, kept = rest.split(TOOL_START, 1)[0], [], [], []
    for block in rest.split(TOOL_START)[1:]:
        body, closed, tail = block.partition(TOOL_END)
        call, error = parse_tool_call(body)
        if call is not None and closed:
            calls.append(call)
        else:
            errors.append(error or "the tool call is not closed with </tool_call> (the reply ended first)")
            kept.append(TOOL_START + block)
            continue
        if tail.strip():
            kept.append(tail)
    content = (head + "".join(kept)).strip() or None
    return ParsedReply(reasoning, content, calls, errors)


def parse_tool_call(body: str) -> tuple[dict | None, str | None]:
    """One ``<tool_call>`` block's body -> (an OpenAI tool call, None) or (None, why not)."""
    stripped = body.strip()
    if stripped.startswith("{"):
        return _json_call(stripped)
    match = _FUNCTION.search(stripped)
    if match is None:
        return None, f"tool call {stripped[:60]!r} is neither <function=NAME> XML nor a JSON object"
    name = match.group(1).strip()
    if not name:
        return None, "tool call has an empty function name"
    arguments = {p.group(1).strip(): _parameter_value(p.group(2)) for p in _PARAMETER.finditer(match.group(2))}
    return _call(name, arguments), None


def _json_call(text: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return None, f"tool call JSON does not parse: {exc}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "tool call JSON has no string 'name'"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None, "tool call JSON 'arguments' is a string that does not parse as JSON"
    if not isinstance(arguments, dict):
        return None, "tool call JSON 'arguments' is not an object"
    return _call(obj["name"], arguments), None


def _parameter_value(raw: str):
    """A parameter's text: JSON when it parses (numbers, objects, booleans), else the string."""
    value = raw.strip("\n")
    try:
        return json.loads(value)
    except ValueError:
        return value


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
