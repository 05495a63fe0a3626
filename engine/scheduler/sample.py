"""Stage 4 of a tick: tokens from the logits the forwards left.

A last chunk's token 0 under the first-token policy (the request then joins the decode batch), the
decode rows' tokens, or the speculative step's accepted tokens; every sampling site masks the rows
a grammar constrains. As the reference, the default stream waits on the prefill stream before each
sampling after a chunk: once for the newborn's token 0, once for the decode rows. A sampler that
raises ends only the requests it sampled for.
"""
from __future__ import annotations

import torch

from engine.cache.pools import CachePools
from engine.model.runner import ModelRunner
from engine.scheduler import forward_failure, grammar_step, logprobs, outputs, spec_step
from engine.scheduler.adaptive import params_for_row
from engine.scheduler.context import TickContext
from engine.scheduler.execute import fail_decode
from engine.scheduler.first_token import FirstTokenPolicy, sample_first_token
from engine.scheduler.plan import KIND_CHUNK, TickPlan
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from engine.scheduler.sampling import effective_min_p, sample_next
from engine.scheduler.streams import EVENT_PREFILL_DONE, STREAM_DEFAULT, STREAM_PREFILL
from engine.scheduler.tick_output import TickOutput
from telemetry import events as ev


def sample(plan: TickPlan, out: TickOutput, ctx: TickContext, queues: Queues, pools: CachePools,
           runner: ModelRunner) -> None:
    if plan.kind == KIND_CHUNK:
        _sample_chunk(plan, out, ctx, queues, pools)
        return
    if out.failed:
        return
    try:
        if out.spec is not None:
            out.num_decode = spec_step.accept_and_keep(ctx, pools, runner, out.spec)
        elif out.decode_logits is not None:
            decode_rows(ctx, pools, out.decode_batch, out.decode_logits)
            out.num_decode = len(out.decode_batch)
    except Exception as exc:
        fail_decode(ctx, pools, out, exc)


def _sample_chunk(plan: TickPlan, out: TickOutput, ctx: TickContext, queues: Queues, pools: CachePools) -> None:
    if not out.chunk_ran:
        return
    if plan.chunk.chunk.is_last:
        _default_waits_for_prefill(ctx)
        _first_token(ctx, queues, pools, plan.chunk.request, out.prefill_logits, out.row)
    if out.decode_logits is None:
        return
    _default_waits_for_prefill(ctx)
    try:
        decode_rows(ctx, pools, out.decode_batch, out.decode_logits)
    except Exception as exc:  # their caches moved on without a token: they cannot go on
        forward_failure.end_requests(ctx, pools, out.decode_batch, exc, stage=forward_failure.STAGE_MIXED_SAMPLING,
                                     path=ev.PATH_MIXED)


def _default_waits_for_prefill(ctx: TickContext) -> None:
    """Record on the prefill stream, make the default stream wait: sampling reads the forward's output."""
    ctx.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)


def _first_token(ctx: TickContext, queues: Queues, pools: CachePools, req: Request, logits: torch.Tensor,
                 row: ev.ChunkDecision) -> None:
    """Sample token 0 under the first-token policy; the request joins the decode batch."""
    traits, levers = ctx.traits, ctx.levers
    try:
        features = req.features
        # A grammar that starts after </think> makes token 0 open a thought (the thinking rule);
        # otherwise the grammar applies to token 0 (the policy's grammar_applies).
        policy = FirstTokenPolicy.for_birth(features.enable_thinking or grammar_step.is_thinking(req),
                                            traits.think_end_id, traits.tool_call_start_id,
                                            req.params.min_tokens, features.require_tool_call)
        req.first_token_rules = row.first_token_rules = ",".join(policy.rules) or None
        min_p = effective_min_p(req.params, levers.speculation, levers.no_mtp_minp)
        params = params_for_row(req.params, req.region, levers.adaptive_sampling)
        allowed = grammar_step.first_token_allowed(ctx, req) if policy.grammar_applies else None
        token = sample_first_token(logits, params, req.generator, policy, traits.eos_ids, min_p, allowed,
                                   prompt_tokens=req.prompt_tokens)
        logprobs.record(req, logits, token)
    except Exception as exc:
        row.outcome = ev.OUTCOME_FAILED_FIRST_TOKEN
        forward_failure.end_requests(ctx, pools, [req], exc, stage=forward_failure.STAGE_FIRST_TOKEN, path=row.path)
        return
    queues.start_decoding(req)
    req.status = ev.REQ_DECODING
    outputs.append_token(ctx, pools, req, token)


def decode_rows(ctx: TickContext, pools: CachePools, batch: list[Request], logits: torch.Tensor) -> None:
    """Sample one token per decode row ([B, V] logits, rows in ``batch`` order)."""
    if not batch:
        return
    levers = ctx.levers
    logits = grammar_step.constrain(ctx, batch, logits)                  # [B, V]
    params = [params_for_row(a.params, a.region, levers.adaptive_sampling) for a in batch]
    tokens = sample_next(
        logits, params, [a.generator for a in batch], [a.num_generated for a in batch], ctx.traits.eos_ids,
        min_p_override=[effective_min_p(a.params, levers.speculation, levers.no_mtp_minp) for a in batch],
        output_tokens=[a.output_tokens for a in batch], prompt_tokens=[a.prompt_tokens for a in batch])
    for row, (request, token) in enumerate(zip(batch, tokens.tolist())):
        logprobs.record(request, logits[row], token)
        outputs.append_token(ctx, pools, request, token)
