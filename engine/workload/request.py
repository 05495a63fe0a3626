"""What every workload yields: one request with its arrival time, prompt and
sampling parameters, plus the helpers the generators share (token ids, lengths).

Pure Python: no torch, so workloads are cheap to build and test.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol, Sequence

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "min_tokens", "max_tokens", "seed")


class WorkloadError(ValueError):
    """Bad workload input: the message names the file, field or option."""


@dataclass
class RequestSpec:
    """One request of a workload. ``sampling`` holds the keys of
    ``SAMPLING_KEYS`` (it maps onto ``SamplingParams.from_dict``)."""

    request_id: int
    arrival_s: float  # seconds after the workload starts
    prompt_tokens: list[int]
    sampling: dict[str, Any]
    conversation_id: int | None = None
    turn: int | None = None
    arrival_tick: int | None = None  # set when replaying a recorded run
    features: dict[str, Any] | None = None  # RequestFeatures as a dict (source, thinking, tool call, ...)
    grammar: dict[str, Any] | None = None  # what the output obeys (engine/grammar/spec.py), or None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)

    @property
    def max_tokens(self) -> int:
        return int(self.sampling["max_tokens"])

    def to_json(self) -> dict[str, Any]:
        """The ``workload.jsonl`` line of this request (see ``bundle.py``)."""
        return {
            "request_id": self.request_id,
            "arrival_tick": self.arrival_tick,
            "arrival_s": self.arrival_s,
            "prompt_tokens": list(self.prompt_tokens),
            "sampling": dict(self.sampling),
            "seed": self.sampling.get("seed"),
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "features": self.features,
            **({"grammar": self.grammar} if self.grammar is not None else {}),
        }


class Workload(Protocol):
    def __iter__(self) -> Iterator[RequestSpec]: ...

    def describe(self) -> dict[str, Any]: ...


def greedy_sampling(max_tokens: int, *, force_length: bool = True, seed: int | None = None) -> dict[str, Any]:
    """Greedy sampling; ``force_length`` bans EOS until ``max_tokens`` so the
    output length is the workload's, not the model's."""
    return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "min_tokens": max_tokens if force_length else 0, "max_tokens": max_tokens, "seed": seed}


def mixed_sampling(rng: random.Random, max_tokens: int, greedy_fraction: float, *, force_length: bool = True) -> dict[str, Any]:
    """Greedy with probability ``greedy_fraction``, else one of the usual
    filter mixes (temperature, top-k, top-p, min-p), each with its own seed."""
    seed = rng.randrange(2**31)
    if rng.random() < greedy_fraction:
        return greedy_sampling(max_tokens, force_length=force_length, seed=seed)
    return {
        "temperature": round(rng.uniform(0.5, 1.2), 3),
        "top_k": rng.choice((0, 20, 50)),
        "top_p": rng.choice((1.0, 0.95, 0.9)),
        "min_p": rng.choice((0.0, 0.0, 0.05)),
        "min_tokens": max_tokens if force_length else 0,
        "max_tokens": max_tokens,
        "seed": seed,
    }


class TokenDrawer:
    """Uniform token ids in ``[0, vocab_size)`` without the excluded (special) ids."""

    def __init__(self, vocab_size: int, excluded_ids: Iterable[int] = ()):
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise WorkloadError(f"vocab_size must be a positive int, got {vocab_size!r}")
        excluded = set(excluded_ids)
        self._allowed = [i for i in range(vocab_size) if i not in excluded]
        if not self._allowed:
            raise WorkloadError(f"excluded_ids leave no token id in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.num_excluded = vocab_size - len(self._allowed)

    def draw(self, rng: random.Random, num_tokens: int) -> list[int]:
        return rng.choices(self._allowed, k=num_tokens)


def clipped_lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """An int length from a lognormal with this median, clipped to [low, high]."""
    value = rng.lognormvariate(math.log(median), sigma) if sigma > 0 else median
    return int(min(high, max(low, round(value))))


def check_sampling_mix(greedy_fraction: Any, seed: Any) -> None:
    """The two knobs every generated workload shares: the greedy share and the seed."""
    if not isinstance(greedy_fraction, (int, float)) or not 0 <= greedy_fraction <= 1:
        raise WorkloadError(f"greedy_fraction must be in [0, 1], got {greedy_fraction!r}")
    if not isinstance(seed, int):
        raise WorkloadError(f"seed must be an int, got {seed!r}")


def build_config(config_cls: type, kind: str, config: dict[str, Any]) -> Any:
    """``config_cls(**config)``; an unknown or missing option becomes a WorkloadError naming it."""
    try:
        return config_cls(**config)
    except TypeError as exc:
        raise WorkloadError(f"{kind} workload: {exc}") from None


def check_positive(name: str, value: Any, *, allow_zero: bool = False, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or (not integer and math.isnan(value)) or (not integer and math.isinf(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise WorkloadError(f"{name} must be {'an int' if integer else 'a number'} {bound}, got {value!r}")


def sort_and_number(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """Arrival order with request ids 0..n-1 in that order (stable on ties)."""
    ordered = sorted(specs, key=lambda s: s.arrival_s)
    for i, spec in enumerate(ordered):
        spec.request_id = i
    return ordered


def length_summary(specs: Sequence[RequestSpec]) -> dict[str, Any]:
    """Counts a run row can show next to the workload parameters."""
    if not specs:
        return {"num_requests": 0}
    prompts = sorted(s.prompt_len for s in specs)
    outputs = sorted(s.max_tokens for s in specs)
    return {
        "num_requests": len(specs),
        "duration_s": round(specs[-1].arrival_s - specs[0].arrival_s, 6),
        "mean_prompt_len": round(sum(prompts) / len(prompts), 2),
        "longest_prompt_len": prompts[-1],
        "mean_output_len": round(sum(outputs) / len(outputs), 2),
        "longest_output_len": outputs[-1],
    }

