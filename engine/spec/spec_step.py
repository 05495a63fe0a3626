"""The speculative decode step (``speculation = ngram``): draft, verify in one forward, keep what matches.

It runs where the reference's speculative step runs: a decode tick with exactly
one active sequence (the width where ``mixing.mixing_blocked_by_spec`` blocks
mixing). With more sequences the decode is a plain batched one.

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
"not d" — the standard rule for a point-mass (n-gram) draft.

Pending drafts: after a step, the next drafts are proposed at once and the SSM
state copy that the next verify rolls back to is made on the secondary stream
(recorded as ``secondary_done``). If the next forward of this sequence is a
mixed one, prefill_step drops the drafts and syncs the secondary stream (the
reference's rule); if it is another speculative step it reuses both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.scheduler import outputs
from engine.scheduler.adaptive import advance, params_for_row
from engine.scheduler.mixing import SPEC_NGRAM
from engine.scheduler.request import Request
from engine.scheduler.sampling import effective_min_p, sample_next
from engine.spec import verify
from engine.spec.ngram import propose_drafts
from engine.streams import EVENT_SECONDARY_DONE, STREAM_DEFAULT, STREAM_SECONDARY
from telemetry import events as ev

if TYPE_CHECKING:
    from engine.scheduler.loop import Scheduler

NUM_DRAFTS = 4          # drafts per step (k): verify rows = k + 1
MAX_NGRAM, MIN_NGRAM = 3, 1
EVENT_VERIFY_DONE = "verify_done"   # default stream finished the step; the state copy may start


def applies(sched: Scheduler) -> bool:
    """Does this decode tick run the speculative step?"""
    return sched.levers.speculation == SPEC_NGRAM and len(sched.active) == 1


def draft_budget(req: Request, *, max_context: int, num_free_blocks: int, blocks_for_tokens) -> int:
    """How many drafts this step may verify: within max_tokens, the context and the free KV blocks.

    A step emits up to k+1 tokens and caches k+1 positions. ``blocks_for_tokens(n)`` is the number
    of new blocks caching n more tokens of this sequence needs.
    """
    budget = min(NUM_DRAFTS, req.params.max_tokens - req.num_generated - 1,
                 max_context - (req.prompt_len + req.num_generated) - 1)
    while budget > 0 and blocks_for_tokens(budget + 1) > num_free_blocks:
        budget -= 1
    return max(budget, 0)


def run(sched: Scheduler) -> int | None:
    """One speculative step for the single active request; tokens computed, or None to decode plainly."""
    req = sched.active[0]
    runner, seq = sched.runner, req.seq
    bm = runner.block_manager
    history = req.prompt_tokens + req.output_tokens
    fed = req.last_token                # the token this step feeds in (not cached yet)
    is_pending_valid = bool(req.pending_drafts) and req.pending_drafts_at == seq.num_cached_tokens
    num_stale = 0 if is_pending_valid else len(req.pending_drafts)
    drafts = list(req.pending_drafts) if is_pending_valid else propose_drafts(
        history, max_ngram=MAX_NGRAM, min_ngram=MIN_NGRAM, num_drafts=NUM_DRAFTS)
    snapshot = req.pending_snapshot if is_pending_valid else None
    req.clear_pending_drafts()
    budget = draft_budget(req, max_context=sched.max_context, num_free_blocks=bm.num_free,
                          blocks_for_tokens=lambda n: bm.num_new_blocks(seq, n))
    drafts = drafts[:budget]
    if not drafts:
        if num_stale:
            _emit(sched, req, num_drafted=0, num_accepted=0, num_emitted=0, num_stale=num_stale,
                  rolled_back=False, reused=False)
        return None

    start = seq.num_cached_tokens
    with sched.streams.use(STREAM_DEFAULT):
        if snapshot is not None:
            # The copy was made on the secondary stream; the verify overwrites the slot after it.
            sched.streams.wait(STREAM_DEFAULT, EVENT_SECONDARY_DONE)
        else:
            snapshot = runner.ssm_pool.snapshot(seq.ssm_slot)
        logits = verify.verify_forward(runner, seq, [fed] + drafts)  # [k+1, V]
        emitted = accept(sched, req, logits, drafts)
    num_accepted = len(emitted) - 1
    for token in emitted:
        outputs.append_token(sched, req, token)
        if req.finished_ns is not None:
            break           # finished: its caches are released, nothing to roll back
    is_rolled_back = req.finished_ns is None and num_accepted < len(drafts)
    if is_rolled_back:
        with sched.streams.use(STREAM_DEFAULT):
            # Cache the token fed in and the accepted drafts; the rejected ones are undone.
            verify.roll_back(runner, seq, snapshot, start, [fed] + drafts[:num_accepted])
    _emit(sched, req, num_drafted=len(drafts), num_accepted=num_accepted, num_emitted=len(emitted),
          num_stale=num_stale, rolled_back=is_rolled_back, reused=is_pending_valid)
    if req.finished_ns is None:
        _propose_next(sched, req)
    return len(drafts) + 1


def accept(sched: Scheduler, req: Request, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The tokens this step emits: sampler picks at rows 0.. while they match the drafts (see module doc)."""
    levers = sched.levers
    min_p = effective_min_p(req.params, levers.speculation, levers.no_mtp_minp)
    region = req.region
    emitted: list[int] = []
    for row in range(len(drafts) + 1):
        params = params_for_row(req.params, region, levers.adaptive_sampling)
        token = int(sample_next(logits[row:row + 1], [params], [req.generator],
                                [req.num_generated + row], sched.eos_ids, min_p_override=[min_p])[0])
        emitted.append(token)
        if row == len(drafts) or token != drafts[row]:
            break
        region = advance(region, token, sched.structure_tokens)
    return emitted


def _propose_next(sched: Scheduler, req: Request) -> None:
    """Draft for the next step now, and copy the SSM state it would roll back to on the secondary stream."""
    drafts = propose_drafts(req.prompt_tokens + req.output_tokens, max_ngram=MAX_NGRAM,
                            min_ngram=MIN_NGRAM, num_drafts=NUM_DRAFTS)
    if not drafts:
        return
    streams = sched.streams
    streams.record(EVENT_VERIFY_DONE, STREAM_DEFAULT)
    streams.wait(STREAM_SECONDARY, EVENT_VERIFY_DONE)
    with streams.use(STREAM_SECONDARY):
        snapshot = sched.runner.ssm_pool.snapshot(req.seq.ssm_slot)
    if streams.is_cuda:
        # Made on the secondary stream, read (restore) on the default one: keep the
        # allocator from reusing the memory before the default stream is done with it.
        default = streams.torch_stream(STREAM_DEFAULT)
        snapshot.conv.record_stream(default)
        snapshot.recurrent.record_stream(default)
    streams.record(EVENT_SECONDARY_DONE, STREAM_SECONDARY)
    req.pending_drafts = drafts
    req.pending_drafts_at = req.seq.num_cached_tokens
    req.pending_snapshot = snapshot


def _emit(sched: Scheduler, req: Request, *, num_drafted: int, num_accepted: int, num_emitted: int,
          num_stale: int, rolled_back: bool, reused: bool) -> None:
    sched.emit(ev.GenericEvent(
        tick=sched.tick, t_ns=sched.now_ns(), kind="spec_step", request_id=req.request_id,
        detail={"kind": SPEC_NGRAM, "path": ev.PATH_DECODE, "num_drafted": num_drafted,
                "num_accepted": num_accepted, "num_emitted": num_emitted,
                "num_stale_dropped": num_stale, "rolled_back": rolled_back,
                "reused_pending": reused}))

