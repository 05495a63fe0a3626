"""What a request asks its output to obey, as plain data (no llguidance here).

A spec is ``{"kind": K, "value": V}``:

- ``json_object``: any JSON object (``value`` is ignored, stored as None);
- ``json_schema``: ``value`` is the schema (a JSON object);
- ``regex``: ``value`` is the pattern (Rust ``regex`` syntax, full match);
- ``choice``: ``value`` is a non-empty list of strings, the output is exactly one of them;
- ``lark``: ``value`` is a Lark grammar (llguidance's dialect).

``after_think`` (bool, default False): the grammar starts after the model's ``</think>``
token, so a thinking reply is free inside its thought and constrained after it.

``lenient`` (bool, default False): JSON schema keywords llguidance does not implement are
ignored (and reported) instead of failing the compile, and ``oneOf`` is treated as ``anyOf``;
the API asks for it unless the client says ``strict``. Absent means strict, so specs stored
before lenient compiles existed replay as they ran.

The dict form is what travels with the request: the ``requests`` row, ``workload.jsonl``
and a replay all carry it, so a replay rebuilds the same grammar.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KIND_JSON_OBJECT = "json_object"
KIND_JSON_SCHEMA = "json_schema"
KIND_REGEX = "regex"
KIND_CHOICE = "choice"
KIND_LARK = "lark"
GRAMMAR_KINDS = (KIND_JSON_OBJECT, KIND_JSON_SCHEMA, KIND_REGEX, KIND_CHOICE, KIND_LARK)
JSON_KINDS = (KIND_JSON_OBJECT, KIND_JSON_SCHEMA)

MAX_GRAMMAR_CHARS = 200_000   # a bound on what one request may ask the compiler to chew


class GrammarSpecError(ValueError):
    """A malformed grammar field; the message names what is wrong."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    value: Any = None
    after_think: bool = False
    lenient: bool = False

    @classmethod
    def parse(cls, raw: Any) -> "GrammarSpec":
        """Check a request's grammar dict; GrammarSpecError names the bad field."""
        if isinstance(raw, GrammarSpec):
            return raw
        if not isinstance(raw, dict):
            raise GrammarSpecError(f"grammar must be an object like {{'kind': 'regex', 'value': '...'}}, "
                                   f"got {type(raw).__name__}")
        unknown = sorted(set(raw) - {"kind", "value", "after_think", "lenient"})
        if unknown:
            raise GrammarSpecError(f"grammar: unknown field(s) {unknown}; "
                                   f"known: ['after_think', 'kind', 'lenient', 'value']")
        kind, value, after_think = raw.get("kind"), raw.get("value"), raw.get("after_think", False)
        lenient = raw.get("lenient", False)
        if not isinstance(lenient, bool):
            raise GrammarSpecError(f"grammar.lenient must be true or false, got {lenient!r}")
        if kind not in GRAMMAR_KINDS:
            raise GrammarSpecError(f"grammar.kind must be one of {list(GRAMMAR_KINDS)}, got {kind!r}")
        if not isinstance(after_think, bool):
            raise GrammarSpecError(f"grammar.after_think must be true or false, got {after_think!r}")
        if kind == KIND_JSON_OBJECT:
            value = None
        elif kind == KIND_JSON_SCHEMA:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise GrammarSpecError(f"grammar.value: the JSON schema is not valid JSON ({exc})") from None
            if not isinstance(value, (dict, bool)):
                raise GrammarSpecError(f"grammar.value: a JSON schema must be an object, got {type(value).__name__}")
        elif kind == KIND_CHOICE:
            if not isinstance(value, (list, tuple)) or not value or \
                    not all(isinstance(v, str) and v for v in value):
                raise GrammarSpecError(f"grammar.value: choice needs a non-empty list of non-empty strings, got {value!r}")
            value = list(value)
        elif not isinstance(value, str) or not value:
            raise GrammarSpecError(f"grammar.value: {kind} needs a non-empty string, got {value!r}")
        spec = cls(kind, value, after_think, lenient)
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise GrammarSpecError(f"grammar.value: {len(spec.text)} characters, more than {MAX_GRAMMAR_CHARS}")
        return spec

    @property
    def text(self) -> str:
        """The grammar as canonical text: the compile cache's key (with the kind)."""
        if self.kind == KIND_JSON_OBJECT:
            return ""
        if isinstance(self.value, str):
            return self.value
        return json.dumps(self.value, sort_keys=True, separators=(",", ":"))

    @property
    def cache_key(self) -> str:
        return f"{self.kind}{' lenient' if self.lenient else ''}\n{self.text}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "value": self.value}
        if self.after_think:
            out["after_think"] = True
        if self.lenient:
            out["lenient"] = True
        return out
