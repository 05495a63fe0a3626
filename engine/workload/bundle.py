"""A recorded run's ``workload.jsonl`` replayed as a workload.

One JSON object per line, one line per request::

    {"request_id": 3, "arrival_tick": 12, "arrival_s": 0.41,
     "prompt_tokens": [..], "sampling": {"temperature": 0.0, ...}, "seed": 7,
     "conversation_id": null, "turn": null}

``arrival_tick`` (the scheduler tick the request arrived at) is what a
replay keys on to reproduce the run's decisions; ``arrival_s`` is kept for
display and for replays that pace by wall clock. ``seed`` at the top level
fills ``sampling.seed`` when the sampling dict has none.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from engine.scheduler.request_features import SOURCE_REPLAY, RequestFeatures
from engine.workload.request import SAMPLING_KEYS, RequestSpec, WorkloadError, length_summary

REQUIRED_FIELDS = ("request_id", "arrival_s", "prompt_tokens", "sampling")


def read_workload_jsonl(path: str | Path, vocab_size: int | None = None) -> list[RequestSpec]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"workload {path}: cannot read ({exc.strerror or exc})") from None
    specs, seen = [], set()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"workload {path} line {line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc.msg})") from None
        spec = _spec_from(obj, where, vocab_size)
        if spec.request_id in seen:
            raise WorkloadError(f"{where}: request_id {spec.request_id} repeats")
        seen.add(spec.request_id)
        specs.append(spec)
    if not specs:
        raise WorkloadError(f"workload {path}: no requests")
    # Arrival order; ties keep the recorded order (by tick, then file order).
    specs.sort(key=lambda s: (s.arrival_tick if s.arrival_tick is not None else -1, s.arrival_s))
    return specs


def _spec_from(obj: Any, where: str, vocab_size: int | None) -> RequestSpec:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in obj:
            raise WorkloadError(f"{where}: missing field {name!r}")
    request_id, arrival_s, tokens, sampling = (obj[n] for n in REQUIRED_FIELDS)
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise WorkloadError(f"{where}: request_id must be an int, got {request_id!r}")
    if not isinstance(arrival_s, (int, float)) or isinstance(arrival_s, bool) or arrival_s < 0:
        raise WorkloadError(f"{where}: arrival_s must be a number >= 0, got {arrival_s!r}")
    tick = obj.get("arrival_tick")
    if tick is not None and (not isinstance(tick, int) or isinstance(tick, bool) or tick < 0):
        raise WorkloadError(f"{where}: arrival_tick must be an int >= 0 or null, got {tick!r}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise WorkloadError(f"{where}: prompt_tokens must be a non-empty list of ints")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise WorkloadError(f"{where}: prompt_tokens holds {bad}, outside the vocabulary [0, {vocab_size})")
    if not isinstance(sampling, dict):
        raise WorkloadError(f"{where}: sampling must be a JSON object, got {type(sampling).__name__}")
    sampling = dict(sampling)
    if "max_tokens" not in sampling:
        raise WorkloadError(f"{where}: sampling.max_tokens is missing")
    if sampling.get("seed") is None and obj.get("seed") is not None:
        sampling["seed"] = obj["seed"]
    features = obj.get("features")
    if features is not None:
        try:
            features = RequestFeatures.from_dict(features).to_dict()
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"{where}: {exc}") from None
    grammar = obj.get("grammar")
    if grammar is not None and not isinstance(grammar, dict):
        raise WorkloadError(f"{where}: grammar must be a JSON object or null, got {type(grammar).__name__}")
    return RequestSpec(request_id=request_id, arrival_s=float(arrival_s), prompt_tokens=tokens,
                       sampling=sampling, conversation_id=obj.get("conversation_id"),
                       turn=obj.get("turn"), arrival_tick=tick, features=features, grammar=grammar)


def write_workload_jsonl(specs: list[RequestSpec], path: str | Path) -> None:
    """The inverse of ``read_workload_jsonl`` (used to save a generated workload)."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for spec in specs:
            handle.write(json.dumps(spec.to_json()) + "\n")


class BundleWorkload:
    def __init__(self, path: str | Path, *, vocab_size: int | None = None):
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "workload.jsonl"
        self._specs = read_workload_jsonl(self.path, vocab_size)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests())

    def requests(self) -> list[RequestSpec]:
        # Fresh copies: a consumer that mutates a spec cannot change the next replay. Served again,
        # each request's source is "replay" (the Requests page filters by it); the rest is as recorded.
        return [RequestSpec(s.request_id, s.arrival_s, list(s.prompt_tokens), dict(s.sampling),
                            s.conversation_id, s.turn, s.arrival_tick,
                            {**(s.features or {}), "source": SOURCE_REPLAY},
                            dict(s.grammar) if s.grammar is not None else None) for s in self._specs]

    def describe(self) -> dict[str, Any]:
        known = [k for k in SAMPLING_KEYS if any(k in s.sampling for s in self._specs)]
        return {"kind": "bundle", "path": str(self.path), "sampling_keys": known,
                "has_ticks": all(s.arrival_tick is not None for s in self._specs),
                **length_summary(self._specs)}
