"""Stage 3 of a chunk tick: run the planned chunk, the reference's decisions in its order.

InnerQ's calibration poll first (where the reference calls ``poll_innerq``), then ONE fused
forward over the chunk and the decode rows when the plan allows it, or a plain ``prefill``
chunk that preempts decode rows while the KV cache is exhausted. A fused forward that finds no
blocks for chunk + rows falls back to the plain path (the row says so); one that raises ends the
prefilling request and puts the decode rows' SSM state back (failure isolation). After a chunk
computed, the SSM normalize and the prefix cache's publish run on the prefill stream, ordered
after the forward that wrote that state. The chunk's ``chunks`` row is built here and completed
when the tick is accounted.
"""
from __future__ import annotations

from engine.cache.kv import KVCacheExhausted
from engine.cache.pools import CachePools
from engine.cache.ssm_pool import SSMSnapshot
from engine.model.forward_batch import ForwardBatch, ForwardOutput, PrefillChunk
from engine.model.runner import ModelRunner
from engine.scheduler import forward_failure, logprobs, prefix_step
from engine.scheduler.context import TickContext
from engine.scheduler.endings import choose_victim, finish, preempt
from engine.scheduler.plan import ChunkStep, TickPlan
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from engine.scheduler.streams import EVENT_DEFAULT_DONE, EVENT_PREFILL_DONE, STREAM_DEFAULT, STREAM_PREFILL, STREAM_SECONDARY
from engine.scheduler.tick_output import TickOutput
from telemetry import events as ev


def execute_chunk(plan: TickPlan, ctx: TickContext, queues: Queues, pools: CachePools,
                  runner: ModelRunner) -> TickOutput:
    step = plan.chunk
    req, chunk, levers = step.request, step.chunk, ctx.levers
    kv_quant_state = _poll_kv_quant(ctx, pools, req)
    start = ctx.now_ns()
    row = ev.ChunkDecision(
        tick=ctx.tick, t_ns=start, request_id=req.request_id, offset=req.chunk_offset, length=chunk.length,
        prompt_len=req.prompt_len, is_last=chunk.is_last, cap_rule=chunk.cap_rule,
        max_prefill_tokens=levers.max_prefill_tokens,
        slice_budget=levers.slice_budget if levers.always_mixed else None,
        ssm_tail_boundary=chunk.ssm_tail_boundary, can_mix=step.verdict.can_mix, mix_blocker=step.verdict.blocker,
        decode_width=len(queues.active), kv_quant_state=kv_quant_state,
        slice_budget_ignored=chunk.slice_budget_ignored)
    out = TickOutput(row=row, chunk_start_ns=start)
    if req.chunk_offset == req.prefix_hit_tokens:  # the first computed chunk (after any cached prefix)
        ctx.emit_request(req, "prefill_start")
    # The prefill stream runs after everything the default stream was given: the slot zeroing and
    # snapshot restore of admission, and the decodes whose state a mixed forward continues.
    ctx.streams.wait_for(STREAM_PREFILL, STREAM_DEFAULT, EVENT_DEFAULT_DONE)
    if step.verdict.can_mix:
        _run_mixed(plan, ctx, queues, pools, runner, out)
    if row.path != ev.PATH_MIXED:
        _run_plain(step, ctx, queues, pools, runner, out)
    return out


def _poll_kv_quant(ctx: TickContext, pools: CachePools, req: Request) -> str:
    """Move InnerQ's calibration on (calibrating -> ready -> applied); a change is one event on
    the timeline. Returns the state this chunk runs under."""
    change = pools.poll_kv_quant()
    if change is not None:
        ctx.event(ev.EVENT_KV_QUANT_STATE, req.request_id, change)
    return pools.kv_quant_state


def _chunk_of(step: ChunkStep) -> PrefillChunk:
    req = step.request
    return PrefillChunk(req.seq, req.prompt_tokens, req.chunk_offset, step.chunk.length, step.chunk.is_last,
                        step.capture_at, every_row=logprobs.wants_prompt_logprobs(req))


def _run_mixed(plan: TickPlan, ctx: TickContext, queues: Queues, pools: CachePools, runner: ModelRunner,
               out: TickOutput) -> None:
    """One fused forward over the chunk and every decode row.

    Leaves ``row.path`` unset when the fused forward found no KV blocks (the plain path runs next).
    """
    step, row = plan.chunk, out.row
    req, drop = step.request, step.drop
    if drop.drop_drafts:
        for active in queues.active:
            active.clear_pending_drafts()
        if drop.sync_secondary:
            ctx.streams.sync(STREAM_SECONDARY)
            ctx.event("drafts_dropped", None, {"num_dropped": drop.num_dropped})
    decodes = list(plan.decode_rows)   # the fused rows in SSM-slot order
    queues.active = list(decodes)
    slots = [a.seq.ssm_slot for a in decodes]
    saved: SSMSnapshot | None = None
    with ctx.streams.use(STREAM_PREFILL):
        try:
            saved = pools.ssm.snapshot_slots(slots)  # put back if the fused forward fails
            result = runner.forward(ForwardBatch.mixed([a.seq for a in decodes], [a.last_token for a in decodes],
                                                       _chunk_of(step)))
        except KVCacheExhausted as exc:
            # The fused forward could not get blocks for chunk + decodes together; the plain
            # path preempts as the reference does, and the row says why it fell back.
            row.outcome = ev.OUTCOME_MIXED_KV_FALLBACK
            ctx.event(ev.OUTCOME_MIXED_KV_FALLBACK, req.request_id, {"error": str(exc)})
            return
        except Exception as exc:
            row.path, row.outcome = ev.PATH_MIXED, ev.OUTCOME_FAILED_FORWARD
            _fail_mixed(ctx, pools, req, decodes, slots, saved, exc)
            return
        row.path = ev.PATH_MIXED
        req.chunk_offset += step.chunk.length
        _after_chunk(ctx, pools, req, step, result)
    out.chunk_ran, out.prefill_logits = True, result.prefill_logits
    out.decode_batch, out.decode_logits, out.num_decode = decodes, result.decode_logits, len(decodes)


def _fail_mixed(ctx: TickContext, pools: CachePools, req: Request, decodes: list[Request], slots: list[int],
                saved: SSMSnapshot | None, exc: Exception) -> None:
    """The fused forward raised: end the prefilling request, put the decode rows' state back.

    ``saved`` is None when taking the snapshot itself failed: no forward ran, nothing moved.
    """
    try:
        if saved is not None:
            pools.ssm.restore_slots(saved, slots)
    except Exception as restore_exc:
        forward_failure.end_prefill(ctx, pools, req, exc, stage=forward_failure.STAGE_MIXED, path=ev.PATH_MIXED)
        forward_failure.end_requests(ctx, pools, decodes, restore_exc, stage=forward_failure.STAGE_RESTORE,
                                     path=ev.PATH_MIXED)
        return
    forward_failure.end_prefill(ctx, pools, req, exc, stage=forward_failure.STAGE_MIXED, path=ev.PATH_MIXED,
                                restored=decodes)


def _run_plain(step: ChunkStep, ctx: TickContext, queues: Queues, pools: CachePools, runner: ModelRunner,
               out: TickOutput) -> None:
    """A plain prefill chunk; while the cache is exhausted, preempt a victim and retry."""
    req, row = step.request, out.row
    row.path = ev.PATH_PREFILL
    with ctx.streams.use(STREAM_PREFILL):
        while True:
            try:
                result = runner.forward(ForwardBatch(prefill=_chunk_of(step)))
                break
            except KVCacheExhausted as exc:
                victim = choose_victim(queues.active, ctx.levers.preempt_policy)
                if victim is None:
                    row.outcome = ev.OUTCOME_FAILED_KV
                    _no_victim(ctx, queues, pools, req, step.chunk.length, exc)
                    return
                preempt(ctx, queues, pools, victim, prefill_request=req)
                row.num_preempted += 1
            except Exception as exc:
                row.outcome = ev.OUTCOME_FAILED_FORWARD
                forward_failure.end_prefill(ctx, pools, req, exc, stage=forward_failure.STAGE_PREFILL,
                                            path=ev.PATH_PREFILL)
                return
        if row.outcome != ev.OUTCOME_MIXED_KV_FALLBACK:
            row.outcome = ev.OUTCOME_OK
        req.chunk_offset += step.chunk.length
        _after_chunk(ctx, pools, req, step, result)
    out.chunk_ran, out.prefill_logits = True, result.prefill_logits


def _no_victim(ctx: TickContext, queues: Queues, pools: CachePools, req: Request, length: int,
               exc: KVCacheExhausted) -> None:
    """Nobody may be preempted for the chunk: the prefill fails, as the reference's does."""
    ctx.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)  # its earlier chunks
    num_held = sum(1 for a in queues.active if a.has_grammar)
    held = f"; {num_held} grammar holder(s) are never preempted" if num_held else ""
    finish(ctx, pools, req, "error",
           f"KV cache exhausted: no request left to preempt for a {length}-token chunk ({exc}){held}")
    if num_held:
        ctx.event("preemption_blocked", req.request_id, {"num_grammar_skipped": num_held})


def _after_chunk(ctx: TickContext, pools: CachePools, req: Request, step: ChunkStep, result: ForwardOutput) -> None:
    """The chunk's prompt logprobs (when asked for), SSM normalization, then the prefix cache's blocks
    and snapshots; on the current (prefill) stream, so on a GPU they read the state the chunk's
    forward wrote, not an older one."""
    if result.chunk_logits is not None:
        logprobs.record_prompt(req, result.chunk_logits, req.chunk_offset - step.chunk.length)
    _normalize(ctx, pools, req)
    prefix_step.on_chunk_done(ctx, pools, req, step.capture_at, result.capture)


def _normalize(ctx: TickContext, pools: CachePools, req: Request) -> None:
    """Bound the SSM state after a chunk; log when it acted or failed (a failure is not fatal)."""
    try:
        acted = pools.normalize(req.seq)
    except Exception as exc:
        ctx.event("ssm_normalize_failed", req.request_id, {"error": str(exc)})
        return
    if acted:
        ctx.event("ssm_normalized", req.request_id, {"offset": req.chunk_offset})
