"""One chunk of the single prefilling request: fused with the decodes, or a plain prefill.

The decisions follow the reference scheduler's single-stream prefill step:
plan the chunk, ask the can-mix rule, then either run ONE mixed forward over
the chunk and the decode batch, or a plain ``prefill_chunk`` that preempts
active sequences while the KV cache is exhausted. Each chunk becomes one
``chunks`` row saying which rule set its length and what blocked mixing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cache.kv import KVCacheExhausted
from engine.cache.ssm_pool import SSMSnapshot
from engine.scheduler import decode_step, forward_failure, grammar_step, logprobs, outputs, prefix_step
from engine.scheduler.adaptive import params_for_row
from engine.scheduler.chunk_plan import ChunkPlan, plan_chunk
from engine.scheduler.first_token import FirstTokenPolicy, sample_first_token
from engine.scheduler.mixing import can_mix, plan_draft_drop
from engine.scheduler.request import Request
from engine.scheduler.sampling import effective_min_p
from engine.scheduler.streams import EVENT_DEFAULT_DONE, EVENT_PREFILL_DONE, STREAM_DEFAULT, STREAM_PREFILL, STREAM_SECONDARY
from telemetry import events as ev

if TYPE_CHECKING:
    from engine.scheduler.loop import Scheduler


def plan(sched: Scheduler, req: Request) -> ChunkPlan:
    levers, runner = sched.levers, sched.runner
    return plan_chunk(
        prompt_len=req.prompt_len, offset=req.chunk_offset,
        max_prefill_tokens=levers.max_prefill_tokens,
        slice_budget=levers.slice_budget if levers.always_mixed else None,
        is_mla=runner.is_mla, block_size=runner.kv_block_size,
        ssm_tail_ckpt=levers.ssm_tail_ckpt, ssm_tail_midchunk=levers.ssm_tail_midchunk,
        tail_split=runner.model.prefill_tail_split(req.prompt_tokens))


def run(sched: Scheduler) -> tuple[str, int, int]:
    """Advance the prefilling request by one chunk; returns (path, prefill tokens, decode tokens)."""
    req = sched.prefilling
    assert req is not None
    kv_quant_state = poll_kv_quant(sched)  # where the reference calls poll_innerq: before planning
    chunk = plan(sched, req)
    verdict = can_mix(bisect_no_mix=sched.levers.bisect_no_mix, num_active=len(sched.active),
                      is_ep=sched.runner.is_ep, speculation=sched.levers.speculation)
    start = sched.now_ns()
    row = ev.ChunkDecision(
        tick=sched.tick, t_ns=start, request_id=req.request_id, offset=req.chunk_offset,
        length=chunk.length, prompt_len=req.prompt_len, is_last=chunk.is_last,
        cap_rule=chunk.cap_rule, max_prefill_tokens=sched.levers.max_prefill_tokens,
        slice_budget=sched.levers.slice_budget if sched.levers.always_mixed else None,
        ssm_tail_boundary=chunk.ssm_tail_boundary, can_mix=verdict.can_mix,
        mix_blocker=verdict.blocker, decode_width=len(sched.active), kv_quant_state=kv_quant_state)
    if req.chunk_offset == req.prefix_hit_tokens:  # the first computed chunk (after any cached prefix)
        sched.emit_request(req, "prefill_start")
    # The prefill stream runs after everything the default stream was given: the slot zeroing and
    # snapshot restore of admission, and the decodes whose state a mixed forward continues.
    sched.streams.wait_for(STREAM_PREFILL, STREAM_DEFAULT, EVENT_DEFAULT_DONE)
    num_decode = 0
    if verdict.can_mix:
        num_decode = _run_mixed(sched, req, chunk, row)
    if row.path != ev.PATH_MIXED:
        _run_plain(sched, req, chunk, row)
    row.duration_ns = sched.now_ns() - start
    if row.outcome in ev.COMPUTED_OUTCOMES:
        row.ep_broadcast_ns = sched.runner.ep_broadcast_ns  # None without expert parallelism
    sched.emit(row)
    return row.path, (chunk.length if row.outcome in ev.COMPUTED_OUTCOMES else 0), num_decode


def poll_kv_quant(sched: Scheduler) -> str:
    """Move InnerQ's calibration on (calibrating -> ready -> applied); a change is one event on
    the timeline. Returns the state this chunk runs under."""
    change = sched.runner.poll_kv_quant()
    if change is not None:
        sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=ev.EVENT_KV_QUANT_STATE,
                                   request_id=sched.prefilling.request_id if sched.prefilling else None,
                                   detail=change))
    return sched.runner.kv_quant_state


def _run_mixed(sched: Scheduler, req: Request, chunk: ChunkPlan, row: ev.ChunkDecision) -> int:
    """One fused forward over the chunk and every decode; returns decode tokens computed.

    Leaves ``row.path`` at prefill when the fused forward found no KV blocks (the caller
    then runs the chunk plainly).
    """
    drop = plan_draft_drop(sched.levers.speculation, [len(a.pending_drafts) for a in sched.active])
    if drop.drop_drafts:
        for active in sched.active:
            active.clear_pending_drafts()
        if drop.sync_secondary:
            sched.streams.sync(STREAM_SECONDARY)
            sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind="drafts_dropped",
                                       detail={"num_dropped": drop.num_dropped}))
    decodes = decode_step.order_batch(sched)
    slots = [a.seq.ssm_slot for a in decodes]
    saved: SSMSnapshot | None = None
    with sched.streams.use(STREAM_PREFILL):
        try:
            saved = sched.runner.ssm_pool.snapshot_slots(slots)  # put back if the fused forward fails
            prefill_logits, decode_logits = sched.runner.mixed_forward(
                [a.seq for a in decodes], [a.last_token for a in decodes], req.seq,
                req.prompt_tokens, req.chunk_offset, chunk.length, chunk.is_last,
                prefix_step.capture_point(sched, req, req.chunk_offset, chunk.length))
        except KVCacheExhausted as exc:
            # The fused forward could not get blocks for chunk + decodes together; the plain
            # path preempts as the reference does, and the row says why it fell back.
            row.outcome = ev.OUTCOME_MIXED_KV_FALLBACK
            sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=ev.OUTCOME_MIXED_KV_FALLBACK,
                                       request_id=req.request_id, detail={"error": str(exc)}))
            return 0
        except Exception as exc:
            row.path, row.outcome = ev.PATH_MIXED, ev.OUTCOME_FAILED_FORWARD
            _fail_mixed(sched, req, decodes, slots, saved, exc)
            return 0
        row.path = ev.PATH_MIXED
        req.chunk_offset += chunk.length
        # The reference bounds the prefill's SSM state after every chunk; here it runs on the
        # prefill stream, ordered after the forward that wrote that state.
        _after_chunk(sched, req, chunk)
    # As the reference: the default stream waits on the prefill stream before each sampling,
    # once for the newborn's first token (last chunk) and once for the decode rows.
    if chunk.is_last:
        _default_waits_for_prefill(sched)
        _first_token(sched, req, prefill_logits, row)
    _default_waits_for_prefill(sched)
    try:
        decode_step.process_logits(sched, decodes, decode_logits)
    except Exception as exc:  # their caches moved on without a token: they cannot go on
        forward_failure.end_requests(sched, decodes, exc, stage=forward_failure.STAGE_MIXED_SAMPLING,
                                     path=ev.PATH_MIXED)
    return len(decodes)


def _fail_mixed(sched: Scheduler, req: Request, decodes: list[Request], slots: list[int],
                saved: SSMSnapshot | None, exc: Exception) -> None:
    """The fused forward raised: end the prefilling request, put the decode rows' state back.

    ``saved`` is None when taking the snapshot itself failed: no forward ran, nothing moved.
    """
    try:
        if saved is not None:
            sched.runner.ssm_pool.restore_slots(saved, slots)
    except Exception as restore_exc:
        forward_failure.end_prefill(sched, req, exc, stage=forward_failure.STAGE_MIXED, path=ev.PATH_MIXED)
        forward_failure.end_requests(sched, decodes, restore_exc, stage=forward_failure.STAGE_RESTORE,
                                     path=ev.PATH_MIXED)
        return
    forward_failure.end_prefill(sched, req, exc, stage=forward_failure.STAGE_MIXED, path=ev.PATH_MIXED,
                                restored=decodes)


def _run_plain(sched: Scheduler, req: Request, chunk: ChunkPlan, row: ev.ChunkDecision) -> None:
    """A plain prefill chunk; while the cache is exhausted, preempt a victim and retry."""
    row.path = ev.PATH_PREFILL
    with sched.streams.use(STREAM_PREFILL):
        while True:
            try:
                logits = sched.runner.prefill_chunk(
                    req.seq, req.prompt_tokens, req.chunk_offset, chunk.length, chunk.is_last,
                    prefix_step.capture_point(sched, req, req.chunk_offset, chunk.length))
                break
            except KVCacheExhausted as exc:
                victim = decode_step.choose_victim(sched)
                if victim is None:
                    row.outcome = ev.OUTCOME_FAILED_KV
                    sched.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)  # its earlier chunks
                    num_held = sum(1 for a in sched.active if a.has_grammar)
                    held = f"; {num_held} grammar holder(s) are never preempted" if num_held else ""
                    sched.finish(req, "error", f"KV cache exhausted: no request left to preempt for a "
                                               f"{chunk.length}-token chunk ({exc}){held}")
                    if num_held:
                        sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind="preemption_blocked",
                                                   request_id=req.request_id,
                                                   detail={"num_grammar_skipped": num_held}))
                    return
                decode_step.preempt(sched, victim, prefill_request=req)
                row.num_preempted += 1
            except Exception as exc:
                row.outcome = ev.OUTCOME_FAILED_FORWARD
                forward_failure.end_prefill(sched, req, exc, stage=forward_failure.STAGE_PREFILL,
                                            path=ev.PATH_PREFILL)
                return
        if row.outcome != ev.OUTCOME_MIXED_KV_FALLBACK:
            row.outcome = ev.OUTCOME_OK
        req.chunk_offset += chunk.length
        _after_chunk(sched, req, chunk)
    if chunk.is_last:
        _default_waits_for_prefill(sched)
        _first_token(sched, req, logits, row)


def _after_chunk(sched: Scheduler, req: Request, chunk: ChunkPlan) -> None:
    """SSM normalization, then the prefix cache's blocks and snapshots; on the current (prefill)
    stream, so on a GPU they read the state the chunk's forward wrote, not an older one."""
    _normalize(sched, req)
    prefix_step.on_chunk_done(sched, req, chunk)


def _default_waits_for_prefill(sched: Scheduler) -> None:
    """Record on the prefill stream, make the default stream wait: sampling reads the forward's output."""
    sched.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)


def _normalize(sched: Scheduler, req: Request) -> None:
    """Bound the SSM state after a chunk; log when it acted or failed (a failure is not fatal)."""
    try:
        acted = sched.runner.normalize_ssm_states(req.seq)
    except Exception as exc:
        sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind="ssm_normalize_failed",
                                   request_id=req.request_id, detail={"error": str(exc)}))
        return
    if acted:
        sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind="ssm_normalized",
                                   request_id=req.request_id, detail={"offset": req.chunk_offset}))


def _first_token(sched: Scheduler, req: Request, logits: torch.Tensor, row: ev.ChunkDecision) -> None:
    """Sample token 0 under the first-token policy; the request joins the decode batch."""
    model = sched.runner.model
    try:
        features = req.features
        # A grammar that starts after </think> makes token 0 open a thought (the thinking rule);
        # otherwise the grammar applies to token 0 (the policy's grammar_applies).
        policy = FirstTokenPolicy.for_birth(features.enable_thinking or grammar_step.is_thinking(req),
                                            model.think_end_id, model.tool_call_start_id,
                                            req.params.min_tokens, features.require_tool_call)
        req.first_token_rules = row.first_token_rules = ",".join(policy.rules) or None
        min_p = effective_min_p(req.params, sched.levers.speculation, sched.levers.no_mtp_minp)
        params = params_for_row(req.params, req.region, sched.levers.adaptive_sampling)
        allowed = grammar_step.first_token_allowed(sched, req) if policy.grammar_applies else None
        token = sample_first_token(logits, params, req.generator, policy, sched.eos_ids, min_p, allowed)
        logprobs.record(req, logits, token)
    except Exception as exc:
        row.outcome = ev.OUTCOME_FAILED_FIRST_TOKEN
        forward_failure.end_requests(sched, [req], exc, stage=forward_failure.STAGE_FIRST_TOKEN, path=row.path)
        return
    sched.prefilling = None
    req.status = ev.REQ_DECODING
    sched.active.append(req)
    outputs.append_token(sched, req, token)
