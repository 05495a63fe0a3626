"""Test-only fault injection: make the model's forward raise when chosen requests are in it.

Not a lever (nothing a dashboard user should flip): a ``ModelRunner.build(fault=...)``
constructor argument, or for a whole engine process the environment variable
``CHUNKSCOPE_FAULT_FORWARD``, read once by ``engine_setup.build_engine``. Its
text is comma-separated request ids, each optionally limited to forward kinds
joined by ``+``: ``"7,12:decode,15:prefill+mixed"`` fails every forward that
carries request 7, decode forwards carrying 12, and plain or mixed prefill
forwards carrying 15.

The raise happens INSIDE the forward, just before the last decoder layer: every
earlier layer has already written its K/V and advanced its SSM state, so the
caches are half-written, exactly what a real kernel failure would leave and what
the scheduler's failure handling must not build on.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from torch import nn

ENV_VAR = "CHUNKSCOPE_FAULT_FORWARD"
KIND_PREFILL, KIND_MIXED, KIND_DECODE = "prefill", "mixed", "decode"
FORWARD_KINDS = (KIND_PREFILL, KIND_MIXED, KIND_DECODE)


class InjectedFault(RuntimeError):
    """The error the fault hook raises (its message names the request and the forward kind)."""


@dataclass(frozen=True)
class ForwardFault:
    """Which requests make which forward kinds fail: request id -> kinds."""

    targets: Mapping[int, frozenset[str]]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ForwardFault | None:
        """The hook ``CHUNKSCOPE_FAULT_FORWARD`` asks for, or None when it is unset or empty."""
        text = environ.get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None

    def describe(self) -> str:
        """The ``parse`` text of this hook (kept in the run's config so a replay fails alike)."""
        return ",".join(f"{r}:{'+'.join(k for k in FORWARD_KINDS if k in kinds)}"
                        for r, kinds in sorted(self.targets.items()))

    @classmethod
    def parse(cls, text: str) -> ForwardFault:
        """``"7,12:decode,15:prefill+mixed"`` -> ForwardFault; a bad item is a ValueError naming it."""
        targets: dict[int, frozenset[str]] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            id_text, _, kinds_text = item.partition(":")
            try:
                request_id = int(id_text)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {item!r} does not start with a request id") from None
            kinds = frozenset(k.strip() for k in kinds_text.split("+")) if kinds_text else frozenset(FORWARD_KINDS)
            unknown = sorted(kinds - set(FORWARD_KINDS))
            if unknown:
                raise ValueError(f"{ENV_VAR}: {item!r} names unknown forward kind(s) {unknown}; "
                                 f"known: {', '.join(FORWARD_KINDS)}")
            targets[request_id] = targets.get(request_id, frozenset()) | kinds
        if not targets:
            raise ValueError(f"{ENV_VAR}: {text!r} names no request id")
        return cls(targets)

    def culprit(self, kind: str, request_ids: Iterable[int]) -> int | None:
        """The first request of this forward that makes a ``kind`` forward fail, or None."""
        return next((r for r in request_ids if kind in self.targets.get(r, ())), None)

    @contextlib.contextmanager
    def armed(self, model: nn.Module, kind: str, request_ids: Iterable[int]) -> Iterator[None]:
        """Within the block, ``model``'s last decoder layer raises InjectedFault when a target is in
        this forward; no hook at all otherwise (the ordinary forward costs nothing extra)."""
        culprit = self.culprit(kind, request_ids)
        if culprit is None:
            yield
            return

        def fail(_module, _inputs):
            raise InjectedFault(f"injected fault: {kind} forward carrying request {culprit} "
                                f"(test hook {ENV_VAR})")

        handle = model.model.layers[-1].register_forward_pre_hook(fail)
        try:
            yield
        finally:
            handle.remove()
