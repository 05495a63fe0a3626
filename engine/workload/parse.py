"""``--workload`` strings to workloads: ``synthetic``, ``trace:PATH``,
``multiturn``, ``bundle:PATH``.

Options come as keyword arguments (CLI flags); ``None`` means "not given",
so a CLI can pass every flag it has and only the set ones count. An option
the chosen workload does not take is an error that names it.
"""
from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any

from engine.workload.bundle import BundleWorkload
from engine.workload.multiturn import MultiTurnConfig, MultiTurnWorkload
from engine.workload.request import Workload, WorkloadError
from engine.workload.synthetic import SyntheticConfig, SyntheticWorkload
from engine.workload.trace import TraceWorkload

KINDS = ("synthetic", "trace:PATH", "multiturn", "bundle:PATH")


def _accepted(kind: str) -> set[str]:
    if kind == "synthetic":
        return {f.name for f in fields(SyntheticConfig)} | {"vocab_size", "excluded_ids"}
    if kind == "multiturn":
        return {f.name for f in fields(MultiTurnConfig)} | {"vocab_size", "excluded_ids"}
    target = TraceWorkload if kind == "trace" else BundleWorkload
    return {name for name in inspect.signature(target.__init__).parameters} - {"self", "path"}


def parse_workload(spec: str, **opts: Any) -> Workload:
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError(f"workload must be one of {', '.join(KINDS)}; got {spec!r}")
    kind, _, path = spec.strip().partition(":")
    if kind not in ("synthetic", "trace", "multiturn", "bundle"):
        raise WorkloadError(f"unknown workload {kind!r}; use one of {', '.join(KINDS)}")
    needs_path = kind in ("trace", "bundle")
    if needs_path and not path:
        raise WorkloadError(f"workload {kind!r} needs a file: {kind}:PATH")
    if not needs_path and path:
        raise WorkloadError(f"workload {kind!r} takes no path, got {spec!r}")
    given = {name: value for name, value in opts.items() if value is not None}
    unknown = sorted(set(given) - _accepted(kind))
    if unknown:
        raise WorkloadError(f"workload {kind!r} does not take option(s) {unknown}; it takes {sorted(_accepted(kind))}")
    if kind == "synthetic":
        return SyntheticWorkload(**_need_vocab(kind, given))
    if kind == "multiturn":
        return MultiTurnWorkload(**_need_vocab(kind, given))
    if kind == "trace":
        return TraceWorkload(path, **_need_vocab(kind, given))
    return BundleWorkload(path, **given)


def _need_vocab(kind: str, given: dict[str, Any]) -> dict[str, Any]:
    if "vocab_size" not in given:
        raise WorkloadError(f"workload {kind!r} draws token ids and needs vocab_size")
    return given
