"""Feed a workload's requests to the serve loop as their arrival times come due."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.workload.images import chat_images, with_images
from engine.workload.multiturn import MultiTurnWorkload
from engine.workload.request import RequestSpec, WorkloadError
from engine.workload.synthetic import SyntheticWorkload
from engine.workload.trace import TraceWorkload

EPOCH_REQUESTS = 256  # an endless synthetic workload is drawn in seeded epochs of this size
DEFAULT_IMAGE_SHARE = 0.5  # of workload requests with an image, on a checkpoint with a vision tower


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
        share = image_share(args, setup)
        if kind == "synthetic":
            if limit is None:
                specs = _endless_synthetic(args, common)
                if share:
                    specs = with_images(specs, setup.scheduler.images, share, args.seed)
                return cls(specs, {"kind": "synthetic", "rate": args.rate, "seed": args.seed, "endless": True,
                                   "grammar_share": getattr(args, "grammar_share", 0.0), "image_share": share})
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
        description = workload.describe()
        if share and kind != "bundle":   # a bundle's requests carry their own images
            specs = list(with_images(specs, setup.scheduler.images, share, args.seed))
            description["image_share"] = share
        return cls(iter(specs), description)

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    def describe_api(self, url: str, key_required: bool = False) -> None:
        """The run also serves API requests at ``url`` (shown with the workload); ``key_required``: it
        asks for an API key (recorded as a fact, never the key: a dashboard restart asks for it again)."""
        self._description["api"] = url
        if key_required:
            self._description["api_key_required"] = True

    @property
    def is_exhausted(self) -> bool:
        return self._next is None

    def next_arrival_s(self) -> float:
        return self._next.arrival_s if self._next is not None else float("inf")

    def due(self, elapsed_s: float) -> Iterator[RequestSpec]:
        while self._next is not None and self._next.arrival_s <= elapsed_s:
            spec, self._next = self._next, next(self._specs, None)
            yield spec


def image_share(args: Any, setup: Any) -> float:
    """``--image-share``: the share of workload requests with an image (default: half on a checkpoint with
    a vision tower that takes images, none otherwise); a share on a text-only model, or with
    ``--limit-mm-per-prompt '{"image": 0}'``, is a one-line error."""
    share = getattr(args, "image_share", None)
    images = getattr(getattr(setup, "scheduler", None), "images", None)
    takes_images = images is not None and images.limits.max_images > 0   # --limit-mm-per-prompt image 0: none
    if share is None:
        return DEFAULT_IMAGE_SHARE if takes_images else 0.0
    if share and images is None:
        raise WorkloadError(f"--image-share {share}: the model has no vision tower")
    if share and not takes_images:
        raise WorkloadError(f"--image-share {share}: --limit-mm-per-prompt allows no images")
    return share


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

    share = image_share(args, setup)
    images = chat_images(setup.scheduler.images, setup.tokenizer, args.seed) if share else ()
    template = ChatTemplate.for_checkpoint(setup.checkpoint_dir)

    def epoch(seed: int, num: int) -> ChatWorkload:
        return ChatWorkload(tokenizer=setup.tokenizer, template=template, images=images, num_requests=num,
                            rate=args.rate, seed=seed, image_share=share)

    if limit is not None:
        workload = epoch(args.seed, limit)
        return WorkloadFeed(iter(workload.requests()), workload.describe())
    description = {"kind": "chat", "rate": args.rate, "seed": args.seed, "endless": True}
    if share:
        description["image_share"] = share
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
