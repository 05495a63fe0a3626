"""Stage 3 of a tick: the forwards the plan asked for, with the preemption retry and failure isolation.

A chunk tick is ``execute_chunk``. A decode tick first makes room: while the rows' next tokens need
more blocks than are free it preempts a victim (the ``preempt_policy`` lever; grammar holders
never), and when only holders are left the rows that get no block wait this tick
(``room.rows_that_wait``). Then the speculative step's verify forward when exactly one row
decodes under speculation (it may decline: no drafts), else ONE decode forward over the rows in
SSM-slot order. A decode forward that raises ends its batch's requests; the queue is served on.
"""
from __future__ import annotations

from engine.cache.pools import CachePools
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.scheduler import forward_failure, room, spec_step
from engine.scheduler.context import TickContext
from engine.scheduler.endings import choose_victim, finish, preempt
from engine.scheduler.execute_chunk import execute_chunk
from engine.scheduler.plan import KIND_CHUNK, TickPlan
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from engine.scheduler.streams import EVENT_SECONDARY_DONE, STREAM_DEFAULT
from engine.scheduler.tick_output import TickOutput
from telemetry import events as ev


def execute(plan: TickPlan, ctx: TickContext, queues: Queues, pools: CachePools, runner: ModelRunner) -> TickOutput:
    if plan.kind == KIND_CHUNK:
        return execute_chunk(plan, ctx, queues, pools, runner)
    out = TickOutput(batch_at_start=list(queues.active))
    try:
        _decode(plan, ctx, queues, pools, runner, out)
    except Exception as exc:
        fail_decode(ctx, pools, out, exc)
    return out


def fail_decode(ctx: TickContext, pools: CachePools, out: TickOutput, exc: Exception) -> None:
    """A decode tick's forward or sampling raised: its batch ends with the error."""
    forward_failure.end_requests(ctx, pools, [a for a in out.batch_at_start if a.finished_ns is None], exc,
                                 stage=forward_failure.STAGE_DECODE, path=ev.PATH_DECODE)
    out.failed, out.num_decode = True, 0


def _decode(plan: TickPlan, ctx: TickContext, queues: Queues, pools: CachePools, runner: ModelRunner,
            out: TickOutput) -> None:
    waiting_rows = _make_room(ctx, queues, pools)
    if not queues.active:
        return
    if not waiting_rows and spec_step.applies(ctx.levers, len(queues.active)):
        out.spec = spec_step.verify_drafts(ctx, pools, runner, queues.active[0])
        if out.spec is not None:
            return
    # The plan's row order, less the rows made room for (an order among the rest is the same).
    left = {id(a) for a in queues.active}
    queues.active = [a for a in plan.decode_rows if id(a) in left]
    waiting = {id(a) for a in waiting_rows}
    batch = [a for a in queues.active if id(a) not in waiting]
    if not batch:
        return
    if any(a.pending_drafts for a in batch):
        # A speculative step drafted on the secondary stream (MTP K/V, a self draft's SSM restore).
        ctx.streams.wait(STREAM_DEFAULT, EVENT_SECONDARY_DONE)
    with ctx.streams.use(STREAM_DEFAULT):
        logits = runner.forward(ForwardBatch.decode([a.seq for a in batch], [a.last_token for a in batch]))
    for detail in runner.take_compile_events():  # a bucket's first compile, or a recompile
        ctx.event(ev.EVENT_DECODE_COMPILE, None, detail)
    out.decode_batch, out.decode_logits = batch, logits.decode_logits


def _make_room(ctx: TickContext, queues: Queues, pools: CachePools) -> list[Request]:
    """Preempt until every active sequence can get the block its next token needs.

    Grammar holders are never victims, so the cache can run out with only holders left to
    grow: then the holders that get no block wait this tick (``room.rows_that_wait``) while
    the others decode, until a finishing request or a failed prefill frees blocks. When no
    row could decode and nothing else holds blocks, waiting would never end: the policy's
    pick among the holders ends with an error (the one case a holder loses its reply).
    Returns the rows that wait.
    """
    bm = pools.blocks
    while queues.active:
        needs = [bm.num_new_blocks(a.seq, 1) for a in queues.active]
        if sum(needs) <= bm.num_free:
            return []
        victim = choose_victim(queues.active, ctx.levers.preempt_policy)
        if victim is not None:
            preempt(ctx, queues, pools, victim, prefill_request=None)
            continue
        admitted = [a.admitted_tick or 0 for a in queues.active]
        waiting = [queues.active[i] for i in room.rows_that_wait(needs, admitted, bm.num_free)]
        prefill_holds_blocks = queues.prefilling is not None and queues.prefilling.seq.num_blocks > 0
        if len(waiting) < len(queues.active) or prefill_holds_blocks:
            ctx.event("decode_rows_wait", None, {"request_ids": [a.request_id for a in waiting],
                                                 "num_free_blocks": bm.num_free})
            return waiting
        doomed = choose_victim(queues.active, ctx.levers.preempt_policy, grammar_exempt=False)
        queues.remove_active(doomed)
        finish(ctx, pools, doomed, "error", f"KV cache exhausted: every sequence left holds a grammar and none "
                                            f"can grow ({bm.num_free} blocks free)")
        queues.mark_done([doomed])
    return []
