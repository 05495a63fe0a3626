"""The speculative decode step (``speculation`` = ngram, mtp or self): draft, verify in one forward, keep what matches.

Two halves in the tick's pipeline: ``verify_drafts`` (execute: drafts, the verify forward) and
``accept_and_keep`` (sample: the exact acceptance, the tokens, the caches cut to what was kept,
the next drafts).

It runs where the reference's speculative step runs: a decode tick with exactly
one active sequence (the width where ``mixing.mixing_blocked_by_spec`` blocks
mixing). With more sequences the decode is a plain batched one. Drafts come
from ``engine/spec/drafts.py`` (k = the ``num_speculative_tokens`` lever).

Acceptance rule (exact-match against the request's own sampler): the verify
forward gives logits at every row of [last, d1..dk]. For i = 0, 1, ... the
sampler picks token t_i from row i exactly as a plain decode step would
(greedy: argmax; sampled: the request's filters and ONE draw from its own
generator, in position order); t_i is emitted; if t_i == d_{i+1} the draft is
accepted and row i+1 is examined, else the step stops. With all k accepted,
t_k is a bonus token, so a step emits 1..k+1 tokens. Each emitted token costs
exactly the draw a plain decode would have made at that position, so greedy
output and a seeded sampled run are token-identical to speculation off (up to
float differences between the verify and decode kernels). For sampled rows
this is a valid speculative sampler: a draft is accepted with probability
p(d), and the emitted token on rejection is distributed as p conditioned on
"not d" — the standard rule for a point-mass draft (every source here drafts
greedily). Under ``mtp`` with ``no_mtp_minp`` on, min-p is not applied (the
event row says so with ``min_p_off``).

After the verify, ``verify.keep`` keeps the state of the last accepted row (no
re-feed); under ``mtp`` the kept rows also feed the MTP layer (its K/V and the
hidden state its next draft starts from).

Pending drafts: after a step, the next drafts are proposed at once, on the
secondary stream (recorded as ``secondary_done``). If the next forward of this
sequence is a mixed one, the chunk's execute drops the drafts and syncs the secondary
stream (the reference's rule); if it is another speculative step it reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.pools import CachePools
from engine.model.runner import ModelRunner
from engine.scheduler import grammar_step, logprobs, outputs
from engine.scheduler.adaptive import advance, params_for_row
from engine.scheduler.context import TickContext
from engine.scheduler.request import Request
from engine.scheduler.sampling import effective_min_p, sample_next
from engine.scheduler.streams import EVENT_SECONDARY_DONE, STREAM_DEFAULT, STREAM_SECONDARY
from engine.spec import drafts as drafts_source
from engine.spec import verify
from engine.spec.kinds import SPEC_MTP, is_speculative
from telemetry import events as ev
from telemetry.levers import LeverValues

EVENT_VERIFY_DONE = "verify_done"   # default stream finished the step; the next drafts may start


@dataclass(frozen=True)
class SpecForward:
    """A verify forward over [the token fed in, drafts]: what ``accept_and_keep`` decides on."""
    request: Request
    fed: int
    drafts: list[int]
    verified: verify.Verified
    num_stale: int
    reused: bool


def applies(levers: LeverValues, num_active: int) -> bool:
    """Does this decode tick run the speculative step?"""
    return is_speculative(levers.speculation) and num_active == 1


def draft_budget(req: Request, *, num_drafts: int, max_context: int, num_free_blocks: int,
                 blocks_for_tokens) -> int:
    """How many drafts this step may verify: within max_tokens, the context and the free KV blocks.

    A step emits up to k+1 tokens and caches k+1 positions. ``blocks_for_tokens(n)`` is the number
    of new blocks caching n more tokens of this sequence needs.
    """
    budget = min(num_drafts, req.params.max_tokens - req.num_generated - 1,
                 max_context - (req.prompt_len + req.num_generated) - 1)
    while budget > 0 and blocks_for_tokens(budget + 1) > num_free_blocks:
        budget -= 1
    return max(budget, 0)


def verify_drafts(ctx: TickContext, pools: CachePools, runner: ModelRunner, req: Request) -> SpecForward | None:
    """Drafts for the single active request and their verify forward; None to decode plainly."""
    seq = req.seq
    fed = req.last_token                # the token this step feeds in (not cached yet)
    is_pending_valid = bool(req.pending_drafts) and req.pending_drafts_at == seq.num_cached_tokens
    num_stale = 0 if is_pending_valid else len(req.pending_drafts)
    budget = _budget(ctx, pools, req)
    if req.pending_drafts:
        # The drafts were made on the secondary stream; what follows reads what they wrote.
        ctx.streams.wait(STREAM_DEFAULT, EVENT_SECONDARY_DONE)
    drafts = list(req.pending_drafts)[:budget] if is_pending_valid else _propose(ctx, runner, req, budget)
    req.clear_pending_drafts()
    if req.grammar is not None:
        # Drafts the grammar refuses could never be emitted: do not spend verify rows on them.
        drafts = drafts[:req.grammar.num_valid_prefix(drafts)]
    if not drafts:
        if num_stale:
            _emit(ctx, req, num_drafted=0, num_accepted=0, num_emitted=0, num_stale=num_stale,
                  rolled_back=False, reused=False)
        return None
    with ctx.streams.use(STREAM_DEFAULT):
        verified = verify.verify_forward(runner, seq, [fed] + drafts,
                                         want_hidden=ctx.levers.speculation == SPEC_MTP)
    return SpecForward(req, fed, drafts, verified, num_stale, is_pending_valid)


def accept_and_keep(ctx: TickContext, pools: CachePools, runner: ModelRunner, spec: SpecForward) -> int:
    """Emit the accepted tokens, keep their caches, draft for the next step; returns tokens computed."""
    req, drafts, verified = spec.request, spec.drafts, spec.verified
    with ctx.streams.use(STREAM_DEFAULT):
        emitted = accept(ctx, req, verified.logits, drafts)
    num_accepted = len(emitted) - 1
    for row, token in enumerate(emitted):
        logprobs.record(req, verified.logits[row], token)
        outputs.append_token(ctx, pools, req, token)
        if req.finished_ns is not None:
            break           # finished: its caches are released, nothing to keep
    is_rolled_back = req.finished_ns is None and num_accepted < len(drafts)
    if req.finished_ns is None:
        with ctx.streams.use(STREAM_DEFAULT):
            # Cache the token fed in and the accepted drafts; the rejected ones are dropped.
            verify.keep(pools, req.seq, verified, num_accepted + 1)
            if ctx.levers.speculation == SPEC_MTP:
                runner.mtp_keep_up_segment(req.seq, [spec.fed] + drafts[:num_accepted], verified.start,
                                           verified.hidden[:num_accepted + 1])
    _emit(ctx, req, num_drafted=len(drafts), num_accepted=num_accepted, num_emitted=len(emitted),
          num_stale=spec.num_stale, rolled_back=is_rolled_back, reused=spec.reused)
    if req.finished_ns is None:
        _propose_next(ctx, pools, runner, req)
    return len(drafts) + 1


def _budget(ctx: TickContext, pools: CachePools, req: Request) -> int:
    bm, seq = pools.blocks, req.seq
    return draft_budget(req, num_drafts=ctx.levers.num_speculative_tokens, max_context=ctx.traits.max_context,
                        num_free_blocks=bm.num_free, blocks_for_tokens=lambda n: bm.num_new_blocks(seq, n))


def _propose(ctx: TickContext, runner: ModelRunner, req: Request, budget: int) -> list[int]:
    levers = ctx.levers
    return drafts_source.propose(levers.speculation, runner, req.seq, req.prompt_tokens + req.output_tokens,
                                 budget, self_layers_lever=levers.self_draft_layers,
                                 ngram_min_match=levers.ngram_min_match)


def accept(ctx: TickContext, req: Request, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The tokens this step emits: sampler picks at rows 0.. while they match the drafts (see module doc)."""
    levers = ctx.levers
    min_p = effective_min_p(req.params, levers.speculation, levers.no_mtp_minp)
    region = req.region
    emitted: list[int] = []
    grammar = req.grammar
    num_advanced = 0
    for row in range(len(drafts) + 1):
        params = params_for_row(req.params, region, levers.adaptive_sampling)
        row_logits = logits[row:row + 1]                                   # [1, V]
        if grammar is not None:
            # Row i's mask is the grammar after the tokens emitted so far in this step.
            row_logits = grammar_step.constrain(ctx, [req], row_logits)
        token = int(sample_next(row_logits, [params], [req.generator],
                                [req.num_generated + row], ctx.traits.eos_ids, min_p_override=[min_p],
                                output_tokens=[req.output_tokens + emitted], prompt_tokens=[req.prompt_tokens])[0])
        emitted.append(token)
        if row == len(drafts) or token != drafts[row]:
            break
        region = advance(region, token, ctx.traits.structure_tokens)
        if grammar is not None:
            is_taken = grammar.advance(token)
            num_advanced += int(is_taken)
            if not is_taken or grammar.is_stopped:
                break   # complete (or refused): append_token ends the request on this token
    if num_advanced:
        # The matcher went ahead with the accepted drafts to mask the rows after them; roll it
        # back so append_token advances it once per emitted token, as a plain decode does.
        grammar.rollback(num_advanced)
    return emitted


def _propose_next(ctx: TickContext, pools: CachePools, runner: ModelRunner, req: Request) -> None:
    """Draft for the next step now, on the secondary stream after this step's work."""
    streams = ctx.streams
    streams.record(EVENT_VERIFY_DONE, STREAM_DEFAULT)
    streams.wait(STREAM_SECONDARY, EVENT_VERIFY_DONE)
    with streams.use(STREAM_SECONDARY):
        drafts = _propose(ctx, runner, req, _budget(ctx, pools, req))
    streams.record(EVENT_SECONDARY_DONE, STREAM_SECONDARY)
    if not drafts:
        return
    req.pending_drafts = drafts
    req.pending_drafts_at = req.seq.num_cached_tokens


def _emit(ctx: TickContext, req: Request, *, num_drafted: int, num_accepted: int, num_emitted: int,
          num_stale: int, rolled_back: bool, reused: bool) -> None:
    levers = ctx.levers
    min_p = effective_min_p(req.params, levers.speculation, levers.no_mtp_minp)
    ctx.event("spec_step", req.request_id,
              {"kind": levers.speculation, "path": ev.PATH_DECODE, "num_drafted": num_drafted,
               "num_accepted": num_accepted, "num_emitted": num_emitted, "num_stale_dropped": num_stale,
               "rolled_back": rolled_back, "reused_pending": reused, "min_p_applied": min_p,
               "min_p_off": min_p != req.params.min_p})
