"""What every stage of a tick reads: the tick's ``TickContext`` (frozen) and the run's ``ModelTraits``.

The scheduler builds one context per tick (and one at each boundary call: submit, cancel,
levers), so a stage sees one levers snapshot, one tick number and one clock for the whole tick.
Events go out through ``emit`` / ``event`` / ``emit_request``; ``grammar_stats`` is the one
mutable thing a context carries: the tick's constrained rows and mask time, grown by the
sampling sites and read when the tick is accounted.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from engine.grammar.masks import MaskStats
from engine.scheduler.adaptive import StructureTokens
from engine.scheduler.streams import StreamSet
from telemetry import events as ev
from telemetry.levers import LeverValues

Emit = Callable[[Any], None]


@dataclass(frozen=True)
class ModelTraits:
    """What the loop's rules need from the model and its tokenizer, fixed for the run."""

    eos_ids: frozenset[int]
    max_context: int
    vocab_size: int
    block_size: int
    is_mla: bool
    is_ep: bool
    has_linear_attention: bool
    structure_tokens: StructureTokens
    think_end_id: int | None
    tool_call_start_id: int | None
    prefill_tail_split: Callable[[list[int]], Any]    # the model's tail split point of a prompt (chunk plan)
    detokenize: Callable[[list[int]], str] | None     # token ids -> text, for stop strings (None: no tokenizer)

    @classmethod
    def of(cls, runner, *, eos_ids: Collection[int] | None, detokenize) -> ModelTraits:
        model = runner.model
        if eos_ids is None:
            eos_ids = {model.eos_token_id} if model.eos_token_id is not None else set()
        return cls(frozenset(eos_ids), runner.config.max_position_embeddings, runner.vocab_size,
                   runner.kv_block_size, runner.is_mla, runner.is_ep, bool(runner.config.linear_attention_layers),
                   StructureTokens(model.code_fence_id, model.tool_call_start_id, model.tool_call_end_id),
                   model.think_end_id, model.tool_call_start_id, model.prefill_tail_split, detokenize)


class RunEvents:
    """Where the run's events go and its time axis: every row carries the tick and the monotonic ns
    since the run started. ``sink`` changes only between ticks (``Scheduler.attach_telemetry``); the
    callbacks of long-lived parts (stream records, prefix-cache evictions) stamp their events here."""

    def __init__(self, sink: Emit | None, clock_ns: Callable[[], int]) -> None:
        self.sink = sink
        self._clock_ns = clock_ns
        self._t0_ns = clock_ns()
        self.tick = 0

    def now_ns(self) -> int:
        return self._clock_ns() - self._t0_ns

    def emit(self, event: Any) -> None:
        if self.sink is not None:
            self.sink(event)

    def stream_event(self, kind: str, stream: str, event_name: str, seq: int, target_stream: str | None,
                     gpu_elapsed_ms: float | None) -> None:
        if self.sink is not None:
            self.sink(ev.StreamEvent(tick=self.tick, t_ns=self.now_ns(), kind=kind, stream=stream,
                                     event_name=event_name, seq=seq, target_stream=target_stream,
                                     gpu_elapsed_ms=gpu_elapsed_ms))

    def generic_event(self, kind: str, request_id: int | None, detail: dict) -> None:
        if self.sink is not None:
            self.sink(ev.GenericEvent(tick=self.tick, t_ns=self.now_ns(), kind=kind, request_id=request_id,
                                      detail=detail))


@dataclass(frozen=True)
class TickContext:
    tick: int
    levers: LeverValues
    traits: ModelTraits
    streams: StreamSet
    sink: Emit | None                 # where events go (None: telemetry off, no event is built)
    now_ns: Callable[[], int]         # monotonic ns since the run started
    grammars: Any                     # engine.grammar.compiler.GrammarCompiler, or None
    last_path: str                    # the path the previous tick took (the decodes-owed rule)
    grammar_stats: MaskStats

    def emit(self, event: Any) -> None:
        if self.sink is not None:
            self.sink(event)

    def event(self, kind: str, request_id: int | None = None, detail: dict | None = None) -> None:
        if self.sink is not None:
            self.sink(ev.GenericEvent(tick=self.tick, t_ns=self.now_ns(), kind=kind, request_id=request_id,
                                      detail=detail if detail is not None else {}))

    def emit_request(self, request, kind: str, detail: str | None = None) -> None:
        """A request's lifecycle event and its updated row."""
        if self.sink is None:
            return
        t_ns = self.now_ns()
        self.sink(ev.RequestEvent(tick=self.tick, t_ns=t_ns, request_id=request.request_id, kind=kind,
                                  detail=detail))
        self.sink(request.record(self.tick, t_ns))
