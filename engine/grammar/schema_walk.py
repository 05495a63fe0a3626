"""Pure walks over a JSON schema: where ``oneOf`` is, what a lenient compile ignored, free strings.

A lenient compile (``compiler.py``) lets llguidance ignore the keywords it does not implement
and treat ``oneOf`` as ``anyOf``; what it ignored is reported, named by keyword (``format:X``
for a format it does not know), so a client knows what its output was not checked against.
``bound_free_strings`` gives every string the schema leaves unbounded a ``maxLength``: a
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
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
ONE_OF = "oneOf"


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


def has_one_of(schema: Any) -> bool:
    return any(isinstance(s.get(ONE_OF), list) for s in subschemas(schema))


def approximations(warnings: list[str], schema: Any = None) -> tuple[str, ...]:
    """The keywords a lenient compile ignored, from llguidance's warnings (and ``oneOf``, which it
    treats as ``anyOf``), sorted; a warning of another shape is kept as its text."""
    found: set[str] = set()
    for warning in warnings:
        unimplemented = _UNIMPLEMENTED.search(warning)
        unknown = _UNKNOWN_FORMAT.search(warning)
        if unimplemented:
            try:
                found.update(str(k) for k in json.loads(unimplemented.group(1)))
            except ValueError:
                found.add(warning)
        elif unknown:
            found.add(f"format:{unknown.group(1)}")
        else:
            found.add(warning)
    if schema is not None and has_one_of(schema):
        found.add(ONE_OF)
    return tuple(sorted(found))


def bound_free_strings(schema: Any, max_length: int) -> Any:
    """A copy of ``schema`` where every string subschema with no length, pattern, format, enum or
    const gets ``maxLength: max_length`` (bounds a model that would not close its strings)."""
    copy = json.loads(json.dumps(schema))
    for sub in subschemas(copy):
        types = sub.get("type")
        is_string = types == "string" or (isinstance(types, list) and "string" in types)
        if is_string and not any(k in sub for k in ("maxLength", "pattern", "format", "enum", "const")):
            sub["maxLength"] = max_length
    return copy
