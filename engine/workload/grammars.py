"""The built-in grammars a synthetic workload draws from (``--grammar-share F``).

Small JSON schemas (objects, arrays, enums, nested objects, bounded strings, integer ranges)
and regexes, each bounded so that a complete answer fits in ``GRAMMAR_MAX_TOKENS`` tokens
even from a byte-level tokenizer: the dashboard then shows grammar decisions (constrained
rows, mask time, skipped preemption victims) without any client.
"""
from __future__ import annotations

import random
from typing import Any

GRAMMAR_MAX_TOKENS = 160   # max_tokens of a synthetic grammar request (a schema answer fits in it)

SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", "pending"]},
                                      "code": {"type": "integer", "minimum": 100, "maximum": 599}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "role": {"enum": ["admin", "user", "guest"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
     "required": ["user", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 10},
                                      "note": {"type": "string", "maxLength": 12}},
     "required": ["ok", "score"], "additionalProperties": False},
)

REGEXES: tuple[str, ...] = (
    r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)",
    r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]",   # [0-9]: a Rust regex \d is any Unicode digit
    r"(GET|POST|PUT) /[a-z]{1,8}(/[a-z0-9]{1,6}){0,2}",
)

CHOICES: tuple[tuple[str, ...], ...] = (("yes", "no", "maybe"), ("red", "green", "blue", "yellow"))


def builtin_grammars() -> list[dict[str, Any]]:
    """Every built-in grammar as a request's grammar dict."""
    return ([{"kind": "json_schema", "value": s} for s in SCHEMAS]
            + [{"kind": "regex", "value": r} for r in REGEXES]
            + [{"kind": "choice", "value": list(c)} for c in CHOICES])


def draw_grammar(rng: random.Random) -> dict[str, Any]:
    """One built-in grammar, schemas twice as likely as regexes or choices."""
    kind = rng.choice(("json_schema", "json_schema", "regex", "choice"))
    if kind == "json_schema":
        return {"kind": kind, "value": rng.choice(SCHEMAS)}
    if kind == "regex":
        return {"kind": kind, "value": rng.choice(REGEXES)}
    return {"kind": kind, "value": list(rng.choice(CHOICES))}
