"""Chunk planning: how many prompt tokens the prefilling request computes this tick.

Pure functions on plain ints. The rules, in the reference scheduler's order:

1. the remaining prompt tokens;
2. capped by ``max_prefill_tokens`` (an MLA model takes the whole remainder
   instead, the reference's rule: its MLA prefill attends only over the
   current call's K/V, so its prompt must never be split; with the
   ``mla_chunked_prefill`` lever on, ours attends over the cached latents and
   chunks like any other model);
3. capped by ``slice_budget`` when the always-mixed lever passes one (the MLA
   whole-prompt rule ignores it for the same reason, and says so:
   ``slice_budget_ignored``);
4. cut at the SSM tail boundary when ``ssm_tail_ckpt`` is on, mid-chunk
   capture is off and the chunk spans the boundary, so an SSM snapshot lands
   exactly where the next turn's prefix match stops;
5. a non-last chunk ends at the model's tail split point when it spans it,
   otherwise on a KV block boundary, so the SSM snapshot taken at its end is
   restorable.

``ChunkPlan.cap_rule`` names the rule that set the final length (a rule that
did not change the length is not credited). Edge cases, decided here:

- Caps are hard limits, alignment is best effort. When the chunk cannot
  reach the next block boundary within its cap (a cap smaller than a block,
  or an unaligned offset left by a tail split), the chunk keeps its capped,
  unaligned length: progress is always >= 1 token, never a zero-length chunk.
- A prompt that is an exact multiple of the block size has its tail boundary
  one block before the end: the boundary is strictly inside the prompt,
  because the end of the prompt is where prefill stops anyway.
- A tail split at or before the offset is already behind us and is ignored;
  one at or beyond the chunk's end is not spanned; a chunk ending exactly on
  it keeps that end (it is a restorable point, no need to align down).
- A last chunk (it reaches the end of the prompt) is never aligned or split.
- The MLA whole-prompt rule skips the SSM tail cut too: splitting would break
  it. The boundary stays on the row (in force), and the prefix step captures
  the SSM state there inside the chunk instead (Kimi Linear's KDA layers keep
  SSM state): the reference cuts there, splitting the prompt its own rule
  says must stay whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from telemetry.events import (
    CAP_BLOCK_ALIGN,
    CAP_MAX_PREFILL,
    CAP_REMAINING,
    CAP_SLICE_BUDGET,
    CAP_SSM_TAIL,
    CAP_TAIL_SPLIT,
    CAP_WHOLE_PROMPT,
)


@dataclass(frozen=True)
class ChunkPlan:
    length: int                         # tokens to compute this tick, >= 1
    is_last: bool                       # the chunk reaches the end of the prompt
    cap_rule: str                       # CAP_* rule that set ``length``
    ssm_tail_boundary: int | None       # the tail boundary in force (None when ssm_tail_ckpt is off)
    slice_budget_ignored: bool = False  # the MLA whole-prompt rule ran past a slice budget in force


def ssm_tail_boundary(prompt_len: int, block_size: int) -> int | None:
    """The last full-block boundary strictly inside the prompt, or None when there is none.

    E.g. block 16: prompt 40 -> 32, prompt 32 -> 16, prompt 16 -> None, prompt 10 -> None.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    boundary = (prompt_len - 1) // block_size * block_size
    return boundary if boundary > 0 else None


def _check_inputs(prompt_len, offset, max_prefill_tokens, slice_budget, block_size, tail_split) -> None:
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if not 0 <= offset < prompt_len:
        raise ValueError(f"offset must be in [0, prompt_len={prompt_len}), got {offset}")
    if max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
    if slice_budget is not None and slice_budget < 1:
        raise ValueError(f"slice_budget must be >= 1 or None, got {slice_budget}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1 or None, got {block_size}")
    if tail_split is not None and tail_split < 0:
        raise ValueError(f"tail_split must be >= 0 or None, got {tail_split}")


def plan_chunk(
    *,
    prompt_len: int,
    offset: int,
    max_prefill_tokens: int,
    slice_budget: int | None,
    is_mla: bool,
    block_size: int | None,
    ssm_tail_ckpt: bool,
    ssm_tail_midchunk: bool,
    tail_split: int | None,
    mla_chunked_prefill: bool = False,
) -> ChunkPlan:
    """Plan the chunk starting at ``offset``; see the module docstring for the rules."""
    _check_inputs(prompt_len, offset, max_prefill_tokens, slice_budget, block_size, tail_split)
    remaining = prompt_len - offset
    length, rule = remaining, CAP_REMAINING
    # The boundary is in force (and on the chunk's row) whenever the lever is on; only without
    # mid-chunk capture does it cut the chunk (with it, the runner captures the state inside).
    tail = ssm_tail_boundary(prompt_len, block_size) if ssm_tail_ckpt and block_size is not None else None

    if whole_prompt_rule(is_mla, mla_chunked_prefill):
        ignored = slice_budget is not None and remaining > slice_budget
        would_split = remaining > max_prefill_tokens or ignored
        return ChunkPlan(remaining, True, CAP_WHOLE_PROMPT if would_split else CAP_REMAINING, tail, ignored)

    if length > max_prefill_tokens:
        length, rule = max_prefill_tokens, CAP_MAX_PREFILL
    if slice_budget is not None and length > slice_budget:
        length, rule = slice_budget, CAP_SLICE_BUDGET

    if tail is not None and not ssm_tail_midchunk and offset < tail < offset + length:
        length, rule = tail - offset, CAP_SSM_TAIL

    end = offset + length
    if end < prompt_len:
        if tail_split is not None and offset < tail_split <= end:
            if tail_split < end:
                length, rule = tail_split - offset, CAP_TAIL_SPLIT
        elif block_size is not None:
            aligned_end = end // block_size * block_size
            if offset < aligned_end < end:
                length, rule = aligned_end - offset, CAP_BLOCK_ALIGN
            # aligned_end <= offset: the cap stops short of the next boundary; keep it (>= 1 token).

    return ChunkPlan(length, offset + length >= prompt_len, rule, tail)


def whole_prompt_rule(is_mla: bool, mla_chunked_prefill: bool) -> bool:
    """Whether a prompt's chunk is its whole remainder: an MLA model under the reference's rule."""
    return is_mla and not mla_chunked_prefill


def first_chunk_tokens(prompt_len: int, max_prefill_tokens: int, whole_prompt: bool) -> int:
    """The tokens of a prompt's first chunk, as admission sizes it: the whole prompt under the rule."""
    return prompt_len if whole_prompt else min(prompt_len, max_prefill_tokens)


def plan_all_chunks(*, prompt_len: int, offset: int = 0, **rules) -> list[tuple[int, ChunkPlan]]:
    """Every (offset, plan) from ``offset`` to the end of the prompt, with fixed rules."""
    plans = []
    while offset < prompt_len:
        plan = plan_chunk(prompt_len=prompt_len, offset=offset, **rules)
        plans.append((offset, plan))
        offset += plan.length
    return plans
