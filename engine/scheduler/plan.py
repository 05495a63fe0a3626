"""Stage 2 of a tick: the plan, decided on values before anything runs (pure: no forward, no event).

A chunk tick advances the prefilling request by one chunk: its length and the cap rule that set it
(``chunk_plan.plan_chunk``), whether it fuses with the decodes and what blocked that
(``mixing.can_mix``), the drafts a fused forward drops (``mixing.plan_draft_drop``), where the SSM
state is captured inside it, and the fused decode rows. A decode tick runs the decode batch,
its rows in SSM-slot order (``mixing.decode_order``). After a plain chunk the decodes are owed
the next tick, so a blocked mix (``bisect_no_mix``, speculation) never starves the running
sequences. A new cap rule is one more input of ``plan_chunk``; a prompt with images gets its
image caps after it (``image_caps.cap_for_images``: the encoder budget, an image kept whole).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.pools import CachePools
from engine.scheduler import prefix_step, siblings
from engine.scheduler.chunk_plan import ChunkPlan, plan_chunk, whole_prompt_rule
from engine.scheduler.context import TickContext
from engine.scheduler.image_caps import cap_for_images, image_spans
from engine.scheduler.mixing import DraftDrop, MixVerdict, can_mix, decode_order, plan_draft_drop
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from telemetry import events as ev

KIND_CHUNK = "chunk"     # a prefill chunk, fused with the decode rows or plain
KIND_DECODE = "decode"
KIND_IDLE = "idle"       # nothing to run: no tick is counted


@dataclass(frozen=True)
class ChunkStep:
    request: Request
    chunk: ChunkPlan                 # length, is_last, the cap rule that set it, the SSM tail boundary
    verdict: MixVerdict              # may it fuse with the decodes; the first blocker when not
    drop: DraftDrop | None           # what a fused forward does with pending drafts (None: no fused forward)
    capture_at: int | None           # SSM state captured inside the chunk (ssm_tail_midchunk, or a whole
                                     # MLA prompt that cannot be cut at the tail), else None


@dataclass(frozen=True)
class TickPlan:
    kind: str
    chunk: ChunkStep | None = None
    decode_rows: tuple[Request, ...] = ()   # the decode batch in row order (a chunk tick: the fused rows)


IDLE = TickPlan(KIND_IDLE)


def plan_tick(ctx: TickContext, queues: Queues, pools: CachePools) -> TickPlan:
    """What this tick runs (after admission)."""
    req, active = queues.prefilling, queues.active
    decodes_owed = ctx.last_path == ev.PATH_PREFILL and bool(active)
    if req is None and not active:
        return IDLE
    if req is None or decodes_owed:
        return TickPlan(KIND_DECODE, decode_rows=tuple(decode_rows(active)))
    levers, traits = ctx.levers, ctx.traits
    tail_ckpt = siblings.tail_ckpt(levers, req.features, prefix_on=pools.prefix is not None)
    chunk = plan_chunk(
        prompt_len=req.prompt_len, offset=req.chunk_offset, max_prefill_tokens=levers.max_prefill_tokens,
        slice_budget=levers.slice_budget if levers.always_mixed else None, is_mla=traits.is_mla,
        block_size=traits.block_size, ssm_tail_ckpt=tail_ckpt, ssm_tail_midchunk=levers.ssm_tail_midchunk,
        tail_split=traits.prefill_tail_split(req.prompt_tokens), mla_chunked_prefill=levers.mla_chunked_prefill)
    if req.seq.images is not None:
        chunk = _capped_for_images(chunk, req, levers, pools)
    verdict = can_mix(bisect_no_mix=levers.bisect_no_mix, num_active=len(active), is_ep=traits.is_ep,
                      speculation=levers.speculation)
    capture_at = prefix_step.capture_point(
        levers, tail_ckpt=tail_ckpt, prefix_on=pools.prefix is not None, has_linear_attention=traits.has_linear_attention,
        block_size=traits.block_size, prompt_len=req.prompt_len, offset=req.chunk_offset, length=chunk.length,
        whole_prompt=whole_prompt_rule(traits.is_mla, levers.mla_chunked_prefill))
    if not verdict.can_mix:
        return TickPlan(KIND_CHUNK, ChunkStep(req, chunk, verdict, None, capture_at))
    drop = plan_draft_drop(levers.speculation, [len(a.pending_drafts) for a in active])
    return TickPlan(KIND_CHUNK, ChunkStep(req, chunk, verdict, drop, capture_at), tuple(decode_rows(active)))


def _capped_for_images(chunk: ChunkPlan, req: Request, levers, pools: CachePools) -> ChunkPlan:
    """``chunk`` shortened by the image caps (``image_caps.cap_for_images``) when one binds."""
    encoded = pools.encoder.__contains__ if pools.encoder is not None else (lambda key: False)
    length, rule = cap_for_images(req.chunk_offset, chunk.length, image_spans(req.seq.images, encoded),
                                  encoder_budget=levers.encoder_budget, image_whole=levers.image_whole)
    if rule is None:
        return chunk
    return dataclasses.replace(chunk, length=length, is_last=False, cap_rule=rule)


def decode_rows(active: Sequence[Request]) -> list[Request]:
    """The decode batch in row order (``mixing.decode_order``: by SSM slot, a sequence without one by
    its request id)."""
    order = decode_order([a.seq.ssm_slot for a in active], [a.request_id for a in active])
    return [active[i] for i in order]
