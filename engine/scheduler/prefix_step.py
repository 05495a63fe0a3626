"""The scheduler's side of the prefix cache (``engine/cache/prefix_pool.py``): where snapshots go, and
the two hooks the stages call (no-ops with the prefix cache off).

SSM snapshots are stored at the snapshot points the levers allow:

* the prompt's tail boundary (its last full block strictly inside the prompt) with
  ``ssm_tail_ckpt`` on, or for the first of n siblings (``siblings.py``): either where the planner cut the chunk, or, with ``ssm_tail_midchunk``
  on, captured inside the chunk by the forward (``capture_point``);
* the end of the prompt when it is block-aligned (always: the state is there).
"""
from __future__ import annotations

from engine.cache.pools import CachePools
from engine.cache.prefix_pool import (EVENT_EVICTED, EVENT_HIT, EVENT_RESTORED, EVENT_SSM_CUT,  # noqa: F401
                                      EVENT_TAKEN, HOW_CHUNK_END, HOW_MIDCHUNK)
from engine.cache.ssm_pool import SSMSnapshot
from engine.scheduler import siblings
from engine.scheduler.chunk_plan import ssm_tail_boundary, whole_prompt_rule
from engine.scheduler.context import TickContext
from engine.scheduler.request import Request
from telemetry.levers import LeverValues

PROMPT_LOGPROBS_MISS = "prompt logprobs asked for: every prompt position is computed"


# ---- pure decisions -------------------------------------------------------------------------
def snapshot_points(tail_ckpt: bool, block_size: int, prompt_len: int) -> set[int]:
    """Prompt positions where an SSM snapshot is stored (``tail_ckpt``: ``siblings.tail_ckpt``)."""
    points = set()
    if tail_ckpt:
        tail = ssm_tail_boundary(prompt_len, block_size)
        if tail is not None:
            points.add(tail)
    if prompt_len % block_size == 0:
        points.add(prompt_len)
    return points


def capture_point(levers: LeverValues, *, tail_ckpt: bool, prefix_on: bool, has_linear_attention: bool,
                  block_size: int, prompt_len: int, offset: int, length: int, whole_prompt: bool = False) -> int | None:
    """The tail boundary when it lies strictly inside this chunk and mid-chunk capture is on.

    ``whole_prompt`` (the MLA whole-prompt rule): the chunk cannot be cut at the boundary, so
    with the tail checkpoint on the state is captured inside it whatever ``ssm_tail_midchunk`` says.
    """
    midchunk = levers.ssm_tail_midchunk or whole_prompt
    if not prefix_on or not (tail_ckpt and midchunk) or not has_linear_attention:
        return None
    tail = ssm_tail_boundary(prompt_len, block_size)
    return tail if tail is not None and offset < tail < offset + length else None


# ---- hooks the stages call ----------------------------------------------------------------
def on_admit(ctx: TickContext, pools: CachePools, req: Request) -> None:
    """Attach the cached prefix of ``req`` (its slot is fresh) and start prefill after it."""
    if pools.prefix is None:
        return
    # The first chunk after the prefix: the whole rest under the MLA whole-prompt rule.
    whole = whole_prompt_rule(ctx.traits.is_mla, ctx.levers.mla_chunked_prefill)
    first_chunk_cap = req.prompt_len if whole else ctx.levers.max_prefill_tokens
    match = pools.prefix.admit(req.request_id, req.prefix_key, req.seq, first_chunk_cap,
                               no_hit=PROMPT_LOGPROBS_MISS if req.features.prompt_logprobs is not None else None)
    req.chunk_offset = match.num_tokens
    req.prefix_hit_tokens = match.num_tokens
    req.prefix_miss_reason = match.miss_reason


def on_chunk_done(ctx: TickContext, pools: CachePools, req: Request, capture_at: int | None,
                  captured: SSMSnapshot | None) -> None:
    """Publish the chunk's full blocks and store the snapshots it reached."""
    if pools.prefix is None:
        return
    tail = siblings.tail_ckpt(ctx.levers, req.features, prefix_on=True)
    points = snapshot_points(tail, ctx.traits.block_size, req.prompt_len)
    pools.prefix.after_chunk(req.request_id, req.prefix_key, req.seq, capture_at=capture_at, captured=captured,
                             snapshot_points=points)
