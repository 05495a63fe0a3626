"""The tick loop: one tick = one forward (mixed, prefill or decode), every decision logged.

A tick is a pipeline of stages over values (``docs/structure.md`` walks one):

    admit(ctx, queues, pools)                       admission: grammar compiles, FIFO head, prefix attach
    plan = plan_tick(ctx, queues, pools)            pure: chunk and its caps, mix verdict, decode rows
    out = execute(plan, ctx, queues, pools, runner) the forwards, the preemption retry, failure isolation
    sample(plan, out, ctx, queues, pools, runner)   token 0, decode rows, speculation, grammar
    account(plan, out, ctx, queues, pools, runner)  the chunk row, the endings, the tick row

``TickContext`` is the tick's frozen view (tick, levers snapshot, clock, events, streams), ``Queues``
the only mutable queue state, ``CachePools`` the caches this scheduler owns. No stage sees the
``Scheduler``; it only wires them, and takes requests, cancels and levers between ticks.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from engine.grammar.masks import MaskStats
from engine.model import reproducible
from engine.model.roofline import MachineRates
from engine.model.runner import ModelRunner
from engine.cache.prefix_pool import PrefixPool
from engine.scheduler import grammar_step
from engine.scheduler.account import account
from engine.scheduler.adaptive import region_of
from engine.scheduler.admission import (RequestRejected, check_features, check_images, check_prompt, mark_rejected,
                                        parse_sampling, recorded_spec, rejected_request, whole_prompt_refusal)
from engine.scheduler.admit import admit
from engine.scheduler.chunk_plan import whole_prompt_rule
from engine.scheduler.context import Emit, ModelTraits, RunEvents, TickContext
from engine.scheduler.endings import finish
from engine.scheduler.execute import execute
from engine.scheduler.plan import KIND_IDLE, plan_tick
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from engine.scheduler.request_features import RequestFeatures
from engine.multimodal.request_images import RequestImages
from engine.scheduler.sample import sample
from engine.scheduler.streams import EVENT_PREFILL_DONE, STREAM_DEFAULT, STREAM_PREFILL, StreamSet
from engine.spec.kinds import SPEC_MTP
from engine.spec.spec_support import speculation_rejection
from telemetry import events as ev
from telemetry.levers import LeverValues

CANCELLED_PREFIX = "cancelled: "   # a cancelled request's error text starts so (replay reads it)


class Scheduler:
    """The running engine's state and the tick pipeline: waiting queue, one prefilling request, the
    decoding batch, the caches.

    Collaborators come in at construction: ``detokenize`` (token ids -> text, for stop strings),
    ``grammars`` (the grammar compile worker), ``eos_ids`` (default: the model's), ``machine_rates``
    (this machine's GEMM rate and read bandwidth: each tick then records its roofline time).
    """

    def __init__(self, runner: ModelRunner, levers: LeverValues, *, emit: Emit | None = None,
                 run_seed: int = 0, clock_ns: Callable[[], int] = time.monotonic_ns,
                 prefix_cache: bool = False, detokenize: Callable[[list[int]], str] | None = None,
                 grammars: Any = None, eos_ids: Collection[int] | None = None,
                 machine_rates: MachineRates | None = None, numerics: str = "native",
                 images: RequestImages | None = None) -> None:
        """``images``: the store and preprocessing of a checkpoint with a vision tower
        (``engine/multimodal/request_images.py``); None refuses requests with images."""
        self.runner = runner
        self.images = images
        # "reproducible": every step runs inside engine/model/reproducible.py's mode (forward and sampling).
        self.numerics = reproducible.check_choice(numerics)
        self.events = RunEvents(emit, clock_ns)
        self.run_seed = run_seed
        self.queues = Queues()
        self.last_path = ev.PATH_IDLE
        self._machine_rates = machine_rates
        self._grammars = grammars               # engine.grammar.compiler.GrammarCompiler, or None
        self.traits = ModelTraits.of(runner, eos_ids=eos_ids, detokenize=detokenize)
        self.streams = StreamSet(runner.device, self.events.stream_event)
        pools = runner.pools
        prefix = None
        if prefix_cache:
            prefix = PrefixPool(pools.blocks, pools.ssm, needs_ssm_snapshot=self.traits.has_linear_attention,
                                events=self.events.generic_event)
        self.pools = pools.with_prefix(prefix)
        self.pools.blocks.set_cap(levers.kv_blocks_cap or None)
        self.levers = self._refuse_unsupported(levers, "off", source="init", version=None)
        runner.mtp_keep_up = self.levers.speculation == SPEC_MTP

    # ---- the tick, the queues and the model's traits, as callers read them ---------------------
    @property
    def tick(self) -> int:
        return self.events.tick

    @tick.setter
    def tick(self, tick: int) -> None:
        """A driver that skips idle time moves the tick between steps (the next arrival's)."""
        self.events.tick = tick

    @property
    def waiting(self):
        return self.queues.waiting

    @property
    def prefilling(self) -> Request | None:
        return self.queues.prefilling

    @property
    def active(self) -> list[Request]:
        return self.queues.active

    @property
    def done(self):
        return self.queues.done

    @property
    def num_done(self) -> int:
        return self.queues.num_done

    @property
    def num_preemptions(self) -> int:
        return self.queues.num_preemptions

    @property
    def grammars(self):
        """The grammar compile worker (None: the checkpoint has no tokenizer)."""
        return self._grammars

    @property
    def prefix(self) -> PrefixPool | None:
        return self.pools.prefix

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.traits.eos_ids

    @property
    def max_context(self) -> int:
        return self.traits.max_context

    @property
    def detokenize(self):
        return self.traits.detokenize

    def keep_recent_done(self, num: int) -> None:
        """Bound ``done`` to the newest ``num`` requests (their rows are already in telemetry)."""
        self.queues.keep_recent_done(num)

    # ---- telemetry --------------------------------------------------------------------
    def attach_telemetry(self, emit: Emit | None) -> None:
        """Send every event from now on to ``emit`` (the writer's, once its run has started)."""
        self.events.sink = emit

    def now_ns(self) -> int:
        """Monotonic ns since the run started: the time axis of every row."""
        return self.events.now_ns()

    def emit(self, event: Any) -> None:
        self.events.emit(event)

    def context(self) -> TickContext:
        """This tick's view for the stages (built once per tick, and at each boundary call)."""
        events = self.events
        return TickContext(events.tick, self.levers, self.traits, self.streams, events.sink, events.now_ns,
                           self._grammars, self.last_path, MaskStats())

    # ---- levers -----------------------------------------------------------------------
    def apply_levers(self, values: LeverValues, *, source: str, version: int | None = None) -> dict:
        """Switch to ``values`` at this tick boundary and log each lever that changed."""
        values = self._refuse_unsupported(values, self.levers.speculation, source=source, version=version)
        changes = values.changes_from(self.levers)
        self.levers = values
        if "kv_blocks_cap" in changes:
            self.pools.blocks.set_cap(values.kv_blocks_cap or None)
        # The MTP layer follows every forward only while it drafts (its K/V costs a layer's work).
        self.runner.mtp_keep_up = values.speculation == SPEC_MTP
        for name, (old, new) in changes.items():
            self.emit(ev.LeverChange(tick=self.tick, t_ns=self.now_ns(), name=name, old=old, new=new,
                                     source=source, status="applied", file_version=version))
        return changes

    def _refuse_unsupported(self, values: LeverValues, previous: str, *, source: str,
                            version: int | None) -> LeverValues:
        """Keep ``previous`` speculation when the model cannot run the asked kind; log the rejection."""
        reason = speculation_rejection(values.speculation, self.runner.model)
        if reason is None:
            return values
        self.emit(ev.LeverChange(tick=self.tick, t_ns=self.now_ns(), name="speculation", old=previous,
                                 new=values.speculation, source=source, status="rejected", reason=reason,
                                 file_version=version))
        return values.replace(speculation=previous)

    def reject_levers(self, reason: str, *, source: str) -> None:
        self.emit(ev.LeverChange(tick=self.tick, t_ns=self.now_ns(), name="*", source=source,
                                 status="rejected", reason=reason))

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request_id: int, prompt_tokens: list[int], sampling: dict | Any,
               *, conversation_id: int | None = None,
               features: RequestFeatures | dict | None = None, grammar: dict | None = None,
               grammar_ready_tick: int | None = None) -> Request:
        """Queue a request, or reject it at once with a message naming the bad field.

        ``grammar`` (``engine/grammar/spec.py``) constrains the output; it compiles off the
        tick loop and the request waits until it is ready (a replay passes the recorded
        ``grammar_ready_tick``)."""
        try:
            feats = check_features(features, self.traits)
            params = parse_sampling(sampling, self.runner.vocab_size)
            if params.seed is None and not params.is_greedy:
                # Every sampled request gets a seed so its run can be replayed exactly.
                params = type(params).from_dict({**params.to_dict(), "seed": self.run_seed * 1_000_003 + request_id})
            bm = self.pools.blocks
            tokens = check_prompt(prompt_tokens, vocab_size=self.runner.vocab_size,
                                  max_context=self.max_context, num_usable_blocks=bm.num_blocks,
                                  block_size=bm.block_size, max_tokens=params.max_tokens)
            prompt_images = check_images(tokens, feats.images, self.images)
            if whole_prompt_rule(self.traits.is_mla, self.levers.mla_chunked_prefill):
                refusal = whole_prompt_refusal(len(tokens), self.levers.max_tick_tokens)
                if refusal is not None:  # at once; admission checks again after a lever change
                    raise RequestRejected(refusal)
        except RequestRejected as exc:
            request = rejected_request(request_id, prompt_tokens, sampling, features, grammar,
                                       vocab_size=self.runner.vocab_size, now_ns=self.now_ns(), tick=self.tick,
                                       conversation_id=conversation_id)
            return self._reject(request, str(exc))
        request = Request(request_id, tokens, params, self.now_ns(), self.tick, conversation_id, feats)
        request.seq.images = prompt_images
        request.region = region_of(tokens, self.traits.structure_tokens)
        if grammar is not None:
            try:
                grammar_step.attach(self._grammars, request, grammar, grammar_ready_tick)
            except RequestRejected as exc:
                if request.grammar_spec is None:   # kept as sent, so a replay rejects it the same way
                    request.grammar_spec = recorded_spec(grammar if isinstance(grammar, dict) else {"kind": grammar})
                return self._reject(request, str(exc))
        self.queues.waiting.append(request)
        self.context().emit_request(request, "arrived")
        return request

    def _reject(self, request: Request, message: str) -> Request:
        mark_rejected(request, message)
        self.queues.mark_done([request])
        self.context().emit_request(request, "rejected", message)
        return request

    @property
    def has_work(self) -> bool:
        return self.queues.has_work

    # ---- one tick ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one tick; False when there was nothing to do (no tick is counted then)."""
        with reproducible.entered(self.numerics):  # no-op in native numerics
            ctx, queues, pools, runner = self.context(), self.queues, self.pools, self.runner
            admit(ctx, queues, pools)
            plan = plan_tick(ctx, queues, pools)
            if plan.kind == KIND_IDLE:
                return False
            start = ctx.now_ns()
            runner.take_forward_cost()  # forwards outside a tick (a draft warm-up) are not this tick's
            out = execute(plan, ctx, queues, pools, runner)
            sample(plan, out, ctx, queues, pools, runner)
            self.last_path = account(plan, out, ctx, queues, pools, runner, start_ns=start,
                                     machine_rates=self._machine_rates)
            self.events.tick += 1
            return True

    # ---- endings from outside the loop (between ticks) ------------------------------------
    def cancel(self, request_id: int, reason: str) -> Request | None:
        """End a queued or running request as ``cancelled``; None when no such request is in flight.

        Call it between ticks (the HTTP server's inbox is drained at tick boundaries, like the
        levers file), never from inside a step.
        """
        queues = self.queues
        request = next((r for r in queues.waiting if r.request_id == request_id), None)
        if request is not None:
            queues.waiting.remove(request)
        elif queues.prefilling is not None and queues.prefilling.request_id == request_id:
            request, queues.prefilling = queues.prefilling, None
            # Its last chunk may still be running on the prefill stream: whatever the default
            # stream does next with the blocks and the slot it frees comes after that chunk.
            self.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)
        else:
            request = next((r for r in queues.active if r.request_id == request_id), None)
            if request is None:
                return None
            queues.remove_active(request)
        self._end_cancelled(request, reason)
        return request

    def _end_cancelled(self, request: Request, reason: str) -> None:
        finish(self.context(), self.pools, request, ev.REQ_CANCELLED, f"{CANCELLED_PREFIX}{reason}",
               status=ev.REQ_CANCELLED)
        self.queues.mark_done([request])

    def stop(self, reason: str = "engine stopped before this request finished") -> None:
        """End everything still queued or running as ``cancelled`` (shutdown)."""
        for request in self.queues.waiting:
            self._end_cancelled(request, reason)
        self.queues.waiting.clear()
        for request in ([self.prefilling] if self.prefilling else []) + list(self.active):
            self.cancel(request.request_id, reason)

