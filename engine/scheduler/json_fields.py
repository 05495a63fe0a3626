"""Dataclasses read back from JSON (a request row, a workload.jsonl line, an API body): strictly.

Typos must not pass silently, and a list field comes back as the tuple the dataclass holds.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any


def strict_kwargs(cls, data: Any, label: str, list_field: str, item_kind: str) -> dict[str, Any]:
    """``data`` checked against ``cls``'s fields, as constructor kwargs; ``list_field`` becomes a tuple.

    Raises ValueError naming ``label`` for a non-object, an unknown key or a non-list ``list_field``.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{label} must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{label}: unknown field(s) {unknown}; known: {sorted(known)}")
    kwargs = dict(data)
    if list_field in kwargs:
        items = kwargs[list_field]
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{label}.{list_field} must be a list of {item_kind}, got {items!r}")
        kwargs[list_field] = tuple(items)
    return kwargs
