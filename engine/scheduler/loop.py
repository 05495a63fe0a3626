"""The tick loop: one tick = one forward (mixed, prefill or decode), every decision logged.

A step reads as the algorithm: apply levers, admit, then either advance the
single prefilling request by one chunk (fused with the decodes when the
can-mix rule allows) or run one decode batch.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.cache.ssm_pool import SSMPoolExhausted
from engine.model.roofline import MachineRates
from engine.model.runner import ModelRunner
from engine.grammar.masks import MaskStats
from engine.scheduler.request_features import RequestFeatures
from engine.scheduler import decode_step, grammar_step, prefill_step, prefix_step
from engine.scheduler.adaptive import StructureTokens, region_of
from engine.scheduler.admission import (RequestRejected, check_prompt, mark_rejected, parse_sampling,
                                        recorded_spec, rejected_request)
from engine.spec.kinds import SPEC_MTP
from engine.scheduler.request import Request
from engine.spec.spec_support import speculation_rejection
from engine.scheduler.streams import EVENT_PREFILL_DONE, STREAM_DEFAULT, STREAM_PREFILL, StreamSet
from telemetry import events as ev
from telemetry.levers import LeverValues

Emit = Callable[[Any], None]
CANCELLED_PREFIX = "cancelled: "   # a cancelled request's error text starts so (replay reads it)


class Scheduler:
    """State of the running engine: waiting queue, one prefilling request, the decoding batch."""

    def __init__(self, runner: ModelRunner, levers: LeverValues, *, emit: Emit | None = None,
                 run_seed: int = 0, clock_ns: Callable[[], int] = time.monotonic_ns,
                 prefix_cache: bool = False) -> None:
        self.runner = runner
        self.levers = levers
        self._emit = emit
        self.run_seed = run_seed
        self._clock_ns = clock_ns
        self._t0_ns = clock_ns()
        self.tick = 0
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.active: list[Request] = []
        # Ended requests, oldest first; a long-running server keeps only the newest
        # (keep_recent_done) so memory stays flat, tests and replays keep them all.
        self.done: list[Request] | deque[Request] = []
        self.num_done = 0
        self.last_path = ev.PATH_IDLE
        self.num_preemptions = 0
        # This machine's GEMM rate and read bandwidth (roofline.measure_rates), set by ``serve``:
        # with them each tick records its forwards' roofline time; None records none.
        self.machine_rates: MachineRates | None = None
        model = runner.model
        self.eos_ids: set[int] = {model.eos_token_id} if model.eos_token_id is not None else set()
        self.structure_tokens = StructureTokens(model.code_fence_id, model.tool_call_start_id,
                                                model.tool_call_end_id)
        self.max_context = runner.config.max_position_embeddings
        # Token ids -> text, for stop strings (set by build_engine when the checkpoint has a tokenizer).
        self.detokenize: Callable[[list[int]], str] | None = None
        self.streams = StreamSet(runner.device, self._on_stream_event)
        self.runner.block_manager.set_cap(levers.kv_blocks_cap or None)
        self.prefix = prefix_step.PrefixStep(self) if prefix_cache else None
        self.grammars = None                  # engine.grammar.compiler.GrammarCompiler (engine_setup attaches it)
        self.grammar_stats = MaskStats()      # this tick's constrained rows and mask time
        self.levers = self._refuse_unsupported(levers, "off", source="init", version=None)
        runner.mtp_keep_up = self.levers.speculation == SPEC_MTP

    def mark_done(self, requests) -> None:
        self.done.extend(requests)
        self.num_done += len(requests)

    def keep_recent_done(self, num: int) -> None:
        """Bound ``done`` to the newest ``num`` requests (their rows are already in telemetry)."""
        self.done = deque(self.done, maxlen=num)

    # ---- telemetry --------------------------------------------------------------------
    def attach_telemetry(self, emit: Emit | None) -> None:
        """Send every event from now on to ``emit`` (the writer's, once its run has started)."""
        self._emit = emit

    def now_ns(self) -> int:
        """Monotonic ns since the run started: the time axis of every row."""
        return self._clock_ns() - self._t0_ns

    def emit(self, event: Any) -> None:
        if self._emit is not None:
            self._emit(event)

    def emit_request(self, request: Request, kind: str, detail: str | None = None) -> None:
        if self._emit is None:
            return
        t_ns = self.now_ns()
        self._emit(ev.RequestEvent(tick=self.tick, t_ns=t_ns, request_id=request.request_id,
                                   kind=kind, detail=detail))
        self._emit(request.record(self.tick, t_ns))

    def _on_stream_event(self, kind: str, stream: str, event_name: str, seq: int,
                         target_stream: str | None, gpu_elapsed_ms: float | None) -> None:
        self.emit(ev.StreamEvent(tick=self.tick, t_ns=self.now_ns(), kind=kind, stream=stream,
                                 event_name=event_name, seq=seq, target_stream=target_stream,
                                 gpu_elapsed_ms=gpu_elapsed_ms))

    # ---- levers -----------------------------------------------------------------------
    def apply_levers(self, values: LeverValues, *, source: str, version: int | None = None) -> dict:
        """Switch to ``values`` at this tick boundary and log each lever that changed."""
        values = self._refuse_unsupported(values, self.levers.speculation, source=source, version=version)
        changes = values.changes_from(self.levers)
        self.levers = values
        if "kv_blocks_cap" in changes:
            self.runner.block_manager.set_cap(values.kv_blocks_cap or None)
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
            feats = self._check_features(features)
            params = parse_sampling(sampling, self.runner.vocab_size)
            if params.seed is None and not params.is_greedy:
                # Every sampled request gets a seed so its run can be replayed exactly.
                params = type(params).from_dict({**params.to_dict(), "seed": self.run_seed * 1_000_003 + request_id})
            bm = self.runner.block_manager
            tokens = check_prompt(prompt_tokens, vocab_size=self.runner.vocab_size,
                                  max_context=self.max_context, num_usable_blocks=bm.num_blocks,
                                  block_size=bm.block_size, max_tokens=params.max_tokens)
        except RequestRejected as exc:
            request = rejected_request(request_id, prompt_tokens, sampling, features, grammar,
                                       vocab_size=self.runner.vocab_size, now_ns=self.now_ns(), tick=self.tick,
                                       conversation_id=conversation_id)
            return self._reject(request, str(exc))
        request = Request(request_id, tokens, params, self.now_ns(), self.tick, conversation_id, feats)
        request.region = region_of(tokens, self.structure_tokens)
        if grammar is not None:
            try:
                grammar_step.attach(self, request, grammar, grammar_ready_tick)
            except RequestRejected as exc:
                if request.grammar_spec is None:   # kept as sent, so a replay rejects it the same way
                    request.grammar_spec = recorded_spec(grammar if isinstance(grammar, dict) else {"kind": grammar})
                return self._reject(request, str(exc))
        self.waiting.append(request)
        self.emit_request(request, "arrived")
        return request

    def _reject(self, request: Request, message: str) -> Request:
        mark_rejected(request, message)
        self.mark_done([request])
        self.emit_request(request, "rejected", message)
        return request

    def _check_features(self, features: RequestFeatures | dict | None) -> RequestFeatures:
        """The request's features, validated against what this model can do."""
        try:
            feats = features if isinstance(features, RequestFeatures) else RequestFeatures.from_dict(features)
            feats.validate()
        except (TypeError, ValueError) as exc:
            raise RequestRejected(str(exc)) from None
        if feats.stop_strings and self.detokenize is None:
            raise RequestRejected("features.stop_strings: the checkpoint has no tokenizer to read text with")
        if feats.require_tool_call and self.runner.model.tool_call_start_id is None:
            raise RequestRejected("features.require_tool_call: the model has no tool-call start token")
        return feats

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active)

    def _admit(self) -> None:
        """Start the next prefill (FIFO) when an SSM slot and its first chunk's blocks are free."""
        grammar_step.poll_waiting(self)
        if self.prefilling is not None or not self.waiting:
            return
        # FIFO among the requests that may start: one still waiting for its grammar's compile
        # does not hold back those behind it.
        head = next((r for r in self.waiting if grammar_step.is_ready(r)), None)
        if head is None:
            return
        bm = self.runner.block_manager
        first_chunk = min(head.prompt_len, self.levers.max_prefill_tokens)
        if self.runner.ssm_pool.num_free == 0 or bm.num_free < bm.num_blocks_for(first_chunk):
            return
        index = self.waiting.index(head)
        del self.waiting[index]
        try:
            self.runner.admit(head.seq)
        except SSMPoolExhausted:  # raced by nothing today, but never lose the request
            self.waiting.insert(index, head)
            return
        prefix_step.on_admit(self, head)
        head.status = ev.REQ_PREFILLING
        head.admitted_ns, head.admitted_tick = self.now_ns(), self.tick
        self.prefilling = head
        self.emit_request(head, "admitted")

    # ---- one tick ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one tick; False when there was nothing to do (no tick is counted then)."""
        self._admit()
        # After a plain prefill chunk the decodes get the next tick, so a blocked mix
        # (bisect_no_mix, speculation) never starves the running sequences.
        decodes_owed = self.last_path == ev.PATH_PREFILL and bool(self.active)
        if self.prefilling is None and not self.active:
            return False
        start = self.now_ns()
        self.runner.take_forward_cost()  # forwards outside a tick (a draft warm-up) are not this tick's
        if self.prefilling is not None and not decodes_owed:
            path, num_prefill, num_decode = prefill_step.run(self)
        else:
            path, num_prefill, num_decode = ev.PATH_DECODE, 0, decode_step.run(self)
        num_finished = self._retire()
        end = self.now_ns()
        bm, pool = self.runner.block_manager, self.runner.ssm_pool
        cost = self.runner.take_forward_cost()
        roofline_ns = None
        if self.machine_rates is not None and (cost.flops or cost.bytes):
            roofline_ns = int(self.machine_rates.seconds(cost) * 1e9)
        self.emit(ev.Tick(
            tick=self.tick, t_ns=start, path=path, duration_ns=end - start,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_active=len(self.active), num_waiting=len(self.waiting),
            num_prefilling=int(self.prefilling is not None), kv_blocks_used=bm.num_used,
            kv_blocks_total=bm.num_usable, ssm_slots_used=pool.num_used,
            ssm_slots_total=pool.num_slots, num_finished=num_finished, roofline_ns=roofline_ns,
            kv_bytes_used=self.runner.kv_bytes_used, kv_bytes_total=self.runner.kv_bytes_total,
            kv_tokens_used=bm.num_used * bm.block_size, kv_tokens_total=(bm.num_used + bm.num_free) * bm.block_size,
            num_constrained_rows=self.grammar_stats.num_rows, grammar_mask_ns=self.grammar_stats.mask_ns))
        self.grammar_stats = MaskStats()
        self.last_path = path
        self.tick += 1
        return True

    def _retire(self) -> int:
        """Move finished or failed requests out of the batch; returns how many finished."""
        ended = [r for r in self.active if r.finished_ns is not None]
        if ended:
            self.active = [r for r in self.active if r.finished_ns is None]
        if self.prefilling is not None and self.prefilling.finished_ns is not None:
            ended.append(self.prefilling)
            self.prefilling = None
        self.mark_done(ended)
        return len(ended)

    # ---- endings --------------------------------------------------------------------------
    def finish(self, request: Request, reason: str, error: str | None = None, *,
               status: str | None = None) -> None:
        """End a request (its tokens or an error), free its caches, log it.

        ``status`` is finished without an error and error with one, unless given
        (preempted, cancelled).
        """
        self.runner.release(request.seq)
        request.finished_ns = self.now_ns()
        request.finish_reason = reason
        request.error = error
        request.status = status or (ev.REQ_FINISHED if error is None else ev.REQ_ERROR)
        request.grammar_valid = grammar_step.output_validates(request)
        request.clear_pending_drafts()  # its SSM copy would outlive the request in ``done``
        self.emit_request(request, "finished" if request.status == ev.REQ_FINISHED else request.status, error)

    def cancel(self, request_id: int, reason: str) -> Request | None:
        """End a queued or running request as ``cancelled``; None when no such request is in flight.

        Call it between ticks (the HTTP server's inbox is drained at tick boundaries, like the
        levers file), never from inside a step.
        """
        request = next((r for r in self.waiting if r.request_id == request_id), None)
        if request is not None:
            self.waiting.remove(request)
        elif self.prefilling is not None and self.prefilling.request_id == request_id:
            request, self.prefilling = self.prefilling, None
            # Its last chunk may still be running on the prefill stream: whatever the default
            # stream does next with the blocks and the slot it frees comes after that chunk.
            self.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)
        else:
            request = next((r for r in self.active if r.request_id == request_id), None)
            if request is None:
                return None
            self.active.remove(request)
        self._end_cancelled(request, reason)
        return request

    def _end_cancelled(self, request: Request, reason: str) -> None:
        self.finish(request, ev.REQ_CANCELLED, f"{CANCELLED_PREFIX}{reason}", status=ev.REQ_CANCELLED)
        self.mark_done([request])

    def stop(self, reason: str = "engine stopped before this request finished") -> None:
        """End everything still queued or running as ``cancelled`` (shutdown)."""
        for request in self.waiting:
            self._end_cancelled(request, reason)
        self.waiting.clear()
        for request in ([self.prefilling] if self.prefilling else []) + list(self.active):
            self.cancel(request.request_id, reason)

