"""OpenAI's structured-output fields -> the engine's grammar; a bad or uncompilable one is a 400.

- ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- ``structured_outputs`` (an extension, as vLLM's): exactly one of ``json`` (a schema),
  ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark, llguidance's dialect); ours
  beside them: ``strict`` and ``max_string_length`` (every string the schema leaves free gets
  that ``maxLength``: a small model inside a free string can run to ``max_tokens``);
- ``tool_choice`` ``"required"`` or a named function, with ``tools``: the reply is one tool
  call whose arguments follow that tool's ``parameters`` schema (``engine/grammar/tools.py``).

JSON schemas compile leniently by default, as vLLM and SGLang run llguidance: keywords it
does not implement (``uniqueItems``, ``not``, ``if``/``then``, unknown ``format``s, ...) are
ignored and ``oneOf`` is treated as ``anyOf``. What was ignored is returned with the grammar
and reported to the client (``grammar_approximations``). ``strict: true`` (OpenAI's flag on a
json_schema or a function; ours on ``structured_outputs``) refuses such a schema instead, with
a 400 naming the keyword.

At most one of the three may constrain a request. With thinking on, the grammar starts after
``</think>``. The grammar compiles here, on the HTTP thread (through the engine's compile
worker and its cache, which the tick loop then hits), so one that does not compile is
answered with a 400 naming the problem before anything reaches the engine.
"""
from __future__ import annotations

from typing import Any

from engine.api.errors import bad_request
from engine.grammar.compiler import GrammarCompileError
from engine.grammar.schema_walk import bound_free_strings
from engine.grammar.spec import GrammarSpec, GrammarSpecError
from engine.grammar.tools import tool_call_spec

COMPILE_TIMEOUT_S = 30.0


def grammar_for(info: Any, *, response_format: Any = None, structured_outputs: Any = None,
                tools: list[dict] | None = None, tool_choice: Any = None,
                enable_thinking: bool = False) -> tuple[dict | None, tuple[str, ...]]:
    """(the request's grammar dict (``engine/grammar/spec.py``), compiled and checked, or None;
    the schema keywords its lenient compile ignored)."""
    asked = {}
    if response_format is not None and response_format.type != "text":
        asked["response_format"] = _from_response_format(response_format, enable_thinking)
    if structured_outputs is not None:
        asked["structured_outputs"] = _from_structured_outputs(structured_outputs, enable_thinking)
    forced_tool = tool_choice == "required" or (tool_choice is not None and not isinstance(tool_choice, str))
    if forced_tool and tools:
        name = None if isinstance(tool_choice, str) else tool_choice.function.name
        strict = any(t.get("function", {}).get("strict") for t in tools)
        try:
            asked["tool_choice"] = tool_call_spec(tools, start_id=info.tool_call_start_id,
                                                  end_id=info.tool_call_end_id, name=name,
                                                  after_think=enable_thinking, lenient=not strict)
        except GrammarSpecError as exc:
            raise bad_request(f"tool_choice: {exc}", "tool_choice") from None
    if not asked:
        return None, ()
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} both constrain the output; give one", next(iter(asked)))
    (param, spec), = asked.items()
    if info.grammars is None:
        raise bad_request(f"{param}: this model has no tokenizer, so no grammar support", param)
    try:
        compiled = info.grammars.compile_now(spec, timeout_s=COMPILE_TIMEOUT_S)
    except GrammarCompileError as exc:
        about = f" [schema keyword: {', '.join(exc.keywords)}]" if exc.keywords else ""
        hint = "; strict refuses it, leave strict off to have it ignored" if exc.keywords and not spec.lenient else ""
        raise bad_request(f"{param}: {exc}{about}{hint}", param, "invalid_grammar") from None
    return spec.to_dict(), compiled.approximations


def _from_response_format(fmt: Any, after_think: bool) -> GrammarSpec:
    if fmt.type == "json_object":
        return GrammarSpec.parse({"kind": "json_object", "after_think": after_think})
    if fmt.json_schema is None:
        raise bad_request("response_format: type json_schema needs a json_schema object with a schema",
                          "response_format")
    return _parse({"kind": "json_schema", "value": fmt.json_schema.schema_, "after_think": after_think,
                   "lenient": not fmt.json_schema.strict}, "response_format.json_schema.schema")


def _from_structured_outputs(so: Any, after_think: bool) -> GrammarSpec:
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar)) if v is not None}
    if len(given) != 1:
        raise bad_request(f"structured_outputs: give exactly one of json, regex, choice, grammar "
                          f"(got {sorted(given) or 'none'})", "structured_outputs")
    (key, value), = given.items()
    kind = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}[key]
    if so.max_string_length is not None:
        if kind != "json_schema":
            raise bad_request("structured_outputs.max_string_length: only with structured_outputs.json",
                              "structured_outputs")
        value = _parse({"kind": kind, "value": value}, "structured_outputs.json").value   # a string schema too
        value = bound_free_strings(value, so.max_string_length)
    return _parse({"kind": kind, "value": value, "after_think": after_think,
                   "lenient": kind == "json_schema" and not so.strict}, f"structured_outputs.{key}")


def _parse(raw: dict, param: str) -> GrammarSpec:
    try:
        return GrammarSpec.parse(raw)
    except GrammarSpecError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
