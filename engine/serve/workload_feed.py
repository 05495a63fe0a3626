"""Feed a workload's requests to the serve loop as their arrival times come due."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.workload.multiturn import MultiTurnWorkload
from engine.workload.request import RequestSpec, WorkloadError
from engine.workload.synthetic import SyntheticWorkload
from engine.workload.trace import TraceWorkload

EPOCH_REQUESTS = 256  # an endless synthetic workload is drawn in seeded epochs of this size


class WorkloadFeed:
    """Requests ordered by arrival; ``due(elapsed_s)`` yields those whose time has come."""

    def __init__(self, specs: Iterator[RequestSpec], description: dict[str, Any]) -> None:
        self._specs = specs
        self._next: RequestSpec | None = next(specs, None)
        self._description = description

    @classmethod
    def from_args(cls, args: Any, setup: Any) -> "WorkloadFeed":
        kind, _, path = args.workload.partition(":")
        limit = args.requests
        if kind == "none":  # API traffic only
            return cls(iter(()), {"kind": "none"})
        if kind == "chat":  # the model's own template and tokenizer, no drawn token ids
            return _chat_feed(args, setup, limit)
        common = {"vocab_size": setup.config.vocab_size, "excluded_ids": setup.special_ids}
        if kind == "synthetic":
            if limit is None:
                return cls(_endless_synthetic(args, common), {"kind": "synthetic", "rate": args.rate,
                                                              "seed": args.seed, "endless": True,
                                                              "grammar_share": getattr(args, "grammar_share", 0.0)})
            workload = SyntheticWorkload(num_requests=limit, rate=args.rate, seed=args.seed,
                                         grammar_share=getattr(args, "grammar_share", 0.0), **common)
        elif kind == "multiturn":
            workload = MultiTurnWorkload(rate=args.rate, seed=args.seed, **common)
        elif kind == "trace":
            if not path:
                raise WorkloadError("--workload trace:PATH needs a CSV path")
            workload = TraceWorkload(path, time_scale=args.time_scale, length_scale=args.length_scale,
                                     start=args.start, limit=args.limit if args.limit is not None else limit,
                                     seed=args.seed, **common)
        elif kind == "bundle":
            from engine.workload.bundle import BundleWorkload
            workload = BundleWorkload(path)
        else:
            raise WorkloadError(f"--workload must be synthetic, chat, multiturn, trace:PATH, bundle:PATH or none, "
                                f"got {args.workload!r}")
        specs = list(workload)
        if limit is not None:
            specs = specs[:limit]
        return cls(iter(specs), workload.describe())

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    def describe_api(self, url: str) -> None:
        """The run also serves API requests at ``url`` (shown with the workload)."""
        self._description["api"] = url

    @property
    def is_exhausted(self) -> bool:
        return self._next is None

    def next_arrival_s(self) -> float:
        return self._next.arrival_s if self._next is not None else float("inf")

    def due(self, elapsed_s: float) -> Iterator[RequestSpec]:
        while self._next is not None and self._next.arrival_s <= elapsed_s:
            spec, self._next = self._next, next(self._specs, None)
            yield spec


def _endless_synthetic(args: Any, common: dict[str, Any]) -> Iterator[RequestSpec]:
    """Epoch after epoch of a seeded synthetic workload, shifted in time and request id."""
    return _endless(lambda epoch: SyntheticWorkload(
        num_requests=EPOCH_REQUESTS, rate=args.rate, seed=args.seed * 7919 + epoch,
        grammar_share=getattr(args, "grammar_share", 0.0), **common).requests(), args.rate)

def _chat_feed(args: Any, setup: Any, limit: int | None) -> "WorkloadFeed":
    """The chat workload in the model's own template: ``limit`` requests, or endless epochs."""
    if setup.tokenizer is None:
        raise WorkloadError(f"--workload chat needs a model with a tokenizer; {setup.model_name} has none")
    from engine.api.chat_template import ChatTemplate
    from engine.workload.chat import ChatWorkload

    def epoch(seed: int, num: int) -> ChatWorkload:
        return ChatWorkload(tokenizer=setup.tokenizer, template=ChatTemplate.for_checkpoint(setup.checkpoint_dir),
                            num_requests=num, rate=args.rate, seed=seed)

    if limit is not None:
        workload = epoch(args.seed, limit)
        return WorkloadFeed(iter(workload.requests()), workload.describe())
    description = {"kind": "chat", "rate": args.rate, "seed": args.seed, "endless": True}
    return WorkloadFeed(_endless(lambda n: epoch(args.seed * 7919 + n, EPOCH_REQUESTS).requests(), args.rate),
                        description)


def _endless(epoch_specs, rate: float) -> Iterator[RequestSpec]:
    """Epoch after epoch of seeded requests (``epoch_specs(n)``), shifted in time and request id."""
    epoch, t_offset = 0, 0.0
    while True:
        specs = epoch_specs(epoch)
        for spec in specs:
            spec.request_id += epoch * EPOCH_REQUESTS
            spec.arrival_s += t_offset
            yield spec
        t_offset = specs[-1].arrival_s + 1.0 / rate
        epoch += 1
