"""Pure functions over a JSON schema and llguidance's words about it: the keywords a lenient compile
ignored or a strict one refused, and bounds for free strings.

A lenient compile (``compiler.py``) lets llguidance ignore the keywords it does not implement
and treat ``oneOf`` as ``anyOf`` where it cannot prove them equal; what it ignored is reported,
named by keyword (``format:X`` for a format it does not know), so a client knows what its
output was not checked against; a refused schema's error names its keyword the same way.
``bound_free_strings`` bounds every string the schema leaves free (values and extra keys): a
small or undertrained model inside a free string can run to ``max_tokens`` before it closes it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

# Keywords whose value maps names to schemas (a key there is a name, never a keyword).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
# llguidance's messages -> the keywords they are about (a warning when lenient, an error when strict).
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_ABOUT = ((re.compile(r"oneOf"), ("oneOf",)),
          (re.compile(r"min/maxProperties"), ("minProperties", "maxProperties")),
          (re.compile(r"not present in a registry|circular references|remote"), ("$ref",)))


def subschemas(schema: Any) -> Iterator[dict]:
    """``schema`` and every schema inside it (depth first)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for child in schema[key].values():
                yield from subschemas(child)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for child in schema[key]:
                yield from subschemas(child)
    for key in _SCHEMA_VALUES:
        child = schema.get(key)
        if isinstance(child, list):   # draft-4 style tuple "items"
            for item in child:
                yield from subschemas(item)
        else:
            yield from subschemas(child)


def keywords_of(message: str) -> tuple[str, ...]:
    """The schema keywords an llguidance warning or error names (``format:X`` for a format it does
    not know); empty when it names none."""
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented:
        try:
            return tuple(str(k) for k in json.loads(unimplemented.group(1)))
        except ValueError:
            pass
    unknown = _UNKNOWN_FORMAT.search(message)
    if unknown:
        return (f"format:{unknown.group(1)}",)
    for pattern, keywords in _ABOUT:
        if pattern.search(message):
            return keywords
    return ()


def approximations(warnings: list[str]) -> tuple[str, ...]:
    """What a lenient compile ignored, from llguidance's warnings, sorted: keywords (``format:X`` for
    an unknown format, ``oneOf`` where it fell back to ``anyOf``), or a warning's text when it names none."""
    found: set[str] = set()
    for warning in warnings:
        found.update(keywords_of(warning) or (warning,))
    return tuple(sorted(found))


def bound_free_strings(schema: Any, max_length: int) -> Any:
    """A copy of ``schema`` whose free strings are at most ``max_length`` characters: every string
    subschema with no length, pattern, format, enum or const gets ``maxLength``, and the extra keys
    of an object whose extra values are unconstrained (no ``patternProperties``, and
    ``additionalProperties`` absent, true or ``{}``) must match ``^.{0,max_length}$``. Every output
    of the copy is valid for the original: it only narrows what the model may write."""
    copy = json.loads(json.dumps(schema))
    for sub in list(subschemas(copy)):
        types = sub.get("type")
        is_string = types == "string" or (isinstance(types, list) and "string" in types)
        if is_string and not any(k in sub for k in ("maxLength", "pattern", "format", "enum", "const")):
            sub["maxLength"] = max_length
        is_object = types == "object" or "properties" in sub or "additionalProperties" in sub
        if is_object and "patternProperties" not in sub and sub.get("additionalProperties", True) in (True, {}):
            sub["patternProperties"] = {f"^.{{0,{max_length}}}$": {}}
            sub["additionalProperties"] = False
    return copy
