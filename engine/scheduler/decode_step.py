"""Decode ticks, decode-logits processing, token bookkeeping and preemption."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.scheduler import forward_failure, grammar_step, logprobs, outputs, room
from engine.scheduler.adaptive import params_for_row
from engine.scheduler.mixing import decode_order
from engine.scheduler.preempt import VictimCandidate, choose_victim as pick_victim
from engine.scheduler.request import Request
from engine.scheduler.sampling import effective_min_p, sample_next
from engine.spec import spec_step
from engine.scheduler.streams import EVENT_SECONDARY_DONE, STREAM_DEFAULT
from telemetry import events as ev

if TYPE_CHECKING:
    from engine.scheduler.loop import Scheduler

PREEMPT_FOR_PREFILL = "preempted: KV cache exhausted (a prefill needed its blocks)"
PREEMPT_FOR_DECODE = "preempted: KV cache exhausted (a decode step needed a new block)"


def run(sched: Scheduler) -> int:
    """One decode forward over the active batch; returns the tokens computed.

    A forward (or its sampling) that raises ends this batch's requests with the error;
    the queue is served on (``forward_failure``).
    """
    batch = list(sched.active)
    try:
        waiting_rows = _make_room(sched)
        if not sched.active:
            return 0
        return _forward_and_sample(sched, waiting_rows)
    except Exception as exc:
        forward_failure.end_requests(sched, [a for a in batch if a.finished_ns is None], exc,
                                     stage=forward_failure.STAGE_DECODE, path=ev.PATH_DECODE)
        return 0


def _forward_and_sample(sched: Scheduler, waiting_rows: list[Request]) -> int:
    if not waiting_rows and spec_step.applies(sched):
        num_computed = spec_step.run(sched)
        if num_computed is not None:
            return num_computed
    batch = [a for a in order_batch(sched) if a not in waiting_rows]
    if not batch:
        return 0
    if any(a.pending_drafts for a in batch):
        # A speculative step drafted on the secondary stream (MTP K/V, a self draft's SSM restore).
        sched.streams.wait(STREAM_DEFAULT, EVENT_SECONDARY_DONE)
    with sched.streams.use(STREAM_DEFAULT):
        logits = sched.runner.decode([a.seq for a in batch], [a.last_token for a in batch])
    for detail in sched.runner.take_compile_events():  # a bucket's first compile, or a recompile
        sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=ev.EVENT_DECODE_COMPILE, detail=detail))
    process_logits(sched, batch, logits)
    return len(batch)


def order_batch(sched: Scheduler) -> list[Request]:
    """Put the active requests in decode-row order (``mixing.decode_order``: by SSM slot, a
    sequence without one by its request id) and return that batch."""
    order = decode_order([a.seq.ssm_slot for a in sched.active], [a.request_id for a in sched.active])
    sched.active = [sched.active[i] for i in order]
    return list(sched.active)


def _make_room(sched: Scheduler) -> list[Request]:
    """Preempt until every active sequence can get the block its next token needs.

    Grammar holders are never victims, so the cache can run out with only holders left to
    grow: then the holders that get no block wait this tick (``room.rows_that_wait``) while
    the others decode, until a finishing request or a failed prefill frees blocks. When no
    row could decode and nothing else holds blocks, waiting would never end: the policy's
    pick among the holders ends with an error (the one case a holder loses its reply).
    Returns the rows that wait.
    """
    bm = sched.runner.block_manager
    while sched.active:
        needs = [bm.num_new_blocks(a.seq, 1) for a in sched.active]
        if sum(needs) <= bm.num_free:
            return []
        victim = choose_victim(sched)
        if victim is not None:
            preempt(sched, victim, prefill_request=None)
            continue
        admitted = [a.admitted_tick or 0 for a in sched.active]
        waiting = [sched.active[i] for i in room.rows_that_wait(needs, admitted, bm.num_free)]
        prefill_holds_blocks = sched.prefilling is not None and sched.prefilling.seq.num_blocks > 0
        if len(waiting) < len(sched.active) or prefill_holds_blocks:
            sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind="decode_rows_wait",
                                       detail={"request_ids": [a.request_id for a in waiting],
                                               "num_free_blocks": bm.num_free}))
            return waiting
        _end_for_room(sched, _pick_ignoring_grammar(sched))
    return []


def _pick_ignoring_grammar(sched: Scheduler) -> Request:
    candidates = [VictimCandidate(request_id=a.request_id, num_blocks=a.seq.num_blocks, has_grammar=False,
                                  admitted_tick=a.admitted_tick or 0, num_output_tokens=a.num_generated)
                  for a in sched.active]
    victim_id = pick_victim(candidates, sched.levers.preempt_policy)
    return next(a for a in sched.active if a.request_id == victim_id)


def _end_for_room(sched: Scheduler, request: Request) -> None:
    sched.active.remove(request)
    sched.finish(request, "error", f"KV cache exhausted: every sequence left holds a grammar and none can "
                                   f"grow ({sched.runner.block_manager.num_free} blocks free)")
    sched.mark_done([request])


def process_logits(sched: Scheduler, batch: list[Request], logits: torch.Tensor) -> None:
    """Sample one token per decode row ([B, V] logits, rows in ``batch`` order)."""
    if not batch:
        return
    levers = sched.levers
    logits = grammar_step.constrain(sched, batch, logits)                  # [B, V]
    params = [params_for_row(a.params, a.region, levers.adaptive_sampling) for a in batch]
    tokens = sample_next(
        logits, params, [a.generator for a in batch],
        [a.num_generated for a in batch], sched.eos_ids,
        min_p_override=[effective_min_p(a.params, levers.speculation, levers.no_mtp_minp) for a in batch])
    for row, (request, token) in enumerate(zip(batch, tokens.tolist())):
        logprobs.record(request, logits[row], token)
        outputs.append_token(sched, request, token)


def choose_victim(sched: Scheduler) -> Request | None:
    """The active sequence the ``preempt_policy`` lever picks, or None when nobody qualifies."""
    candidates = [VictimCandidate(request_id=a.request_id, num_blocks=a.seq.num_blocks,
                                  has_grammar=a.has_grammar, admitted_tick=a.admitted_tick or 0,
                                  num_output_tokens=a.num_generated) for a in sched.active]
    victim_id = pick_victim(candidates, sched.levers.preempt_policy)
    if victim_id is None:
        return None
    return next(a for a in sched.active if a.request_id == victim_id)


def preempt(sched: Scheduler, victim: Request, *, prefill_request: Request | None) -> None:
    """End ``victim`` with the preemption error, free its blocks and slot, log it."""
    num_grammar_skipped = sum(1 for a in sched.active if a.has_grammar)
    sched.active.remove(victim)
    blocks_before = sched.runner.block_manager.num_free
    reason = PREEMPT_FOR_PREFILL if prefill_request is not None else PREEMPT_FOR_DECODE
    sched.finish(victim, "error", reason, status=ev.REQ_PREEMPTED)
    sched.mark_done([victim])
    sched.num_preemptions += 1
    sched.emit(ev.Preemption(
        tick=sched.tick, t_ns=sched.now_ns(), victim_request_id=victim.request_id,
        blocks_freed=sched.runner.block_manager.num_free - blocks_before, reason=reason,
        policy=sched.levers.preempt_policy,
        prefill_request_id=prefill_request.request_id if prefill_request else None,
        num_remaining=len(sched.active), num_grammar_skipped=num_grammar_skipped))
