"""How a request ends inside the loop: finished, failed, preempted; its caches go back to the pools.

``finish`` ends one request (its tokens or an error) and logs it; ``preempt`` ends a decode-batch
victim the KV cache needs room from; ``choose_victim`` asks the ``preempt_policy`` lever which one.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.cache.pools import CachePools
from engine.scheduler import grammar_step
from engine.scheduler.context import TickContext
from engine.scheduler.preempt import VictimCandidate, choose_victim as pick_victim
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from telemetry import events as ev

PREEMPT_FOR_PREFILL = "preempted: KV cache exhausted (a prefill needed its blocks)"
PREEMPT_FOR_DECODE = "preempted: KV cache exhausted (a decode step needed a new block)"


def finish(ctx: TickContext, pools: CachePools, request: Request, reason: str, error: str | None = None, *,
           status: str | None = None) -> None:
    """End a request (its tokens or an error), free its caches, log it.

    ``status`` is finished without an error and error with one, unless given (preempted, cancelled).
    """
    pools.release(request.seq)
    request.finished_ns = ctx.now_ns()
    request.finish_reason = reason
    request.error = error
    request.status = status or (ev.REQ_FINISHED if error is None else ev.REQ_ERROR)
    request.grammar_valid = grammar_step.output_validates(request)
    request.clear_pending_drafts()  # its SSM copy would outlive the request in ``done``
    ctx.emit_request(request, "finished" if request.status == ev.REQ_FINISHED else request.status, error)


def victim_candidates(active: Sequence[Request], *, grammar_exempt: bool = True) -> list[VictimCandidate]:
    return [VictimCandidate(request_id=a.request_id, num_blocks=a.seq.num_blocks,
                            has_grammar=a.has_grammar and grammar_exempt, admitted_tick=a.admitted_tick or 0,
                            num_output_tokens=a.num_generated) for a in active]


def choose_victim(active: Sequence[Request], policy: str, *, grammar_exempt: bool = True) -> Request | None:
    """The decode-batch request the ``preempt_policy`` lever picks, or None when nobody qualifies
    (grammar holders never do, unless ``grammar_exempt`` is off)."""
    victim_id = pick_victim(victim_candidates(active, grammar_exempt=grammar_exempt), policy)
    if victim_id is None:
        return None
    return next(a for a in active if a.request_id == victim_id)


def preempt(ctx: TickContext, queues: Queues, pools: CachePools, victim: Request, *,
            prefill_request: Request | None) -> None:
    """End ``victim`` with the preemption error, free its blocks and slot, log it."""
    num_grammar_skipped = sum(1 for a in queues.active if a.has_grammar)
    queues.remove_active(victim)
    blocks_before = pools.blocks.num_free
    reason = PREEMPT_FOR_PREFILL if prefill_request is not None else PREEMPT_FOR_DECODE
    finish(ctx, pools, victim, "error", reason, status=ev.REQ_PREEMPTED)
    queues.mark_done([victim])
    queues.num_preemptions += 1
    ctx.emit(ev.Preemption(
        tick=ctx.tick, t_ns=ctx.now_ns(), victim_request_id=victim.request_id,
        blocks_freed=pools.blocks.num_free - blocks_before, reason=reason, policy=ctx.levers.preempt_policy,
        prefill_request_id=prefill_request.request_id if prefill_request else None,
        num_remaining=len(queues.active), num_grammar_skipped=num_grammar_skipped))
