"""Why the head of the waiting queue cannot start: a pure decision, and the values it reads.

Admission is FIFO: while the head request cannot get an SSM slot and the KV
blocks of its first chunk, nothing behind it starts. When nothing else runs
either, the engine makes no progress until a lever (``kv_blocks_cap``) or an
ending request frees room. The serve loop then waits instead of re-stepping,
and says what blocks it (log, telemetry event, heartbeat file, Live page).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.scheduler.chunk_plan import first_chunk_tokens


@dataclass(frozen=True)
class HeadNeeds:
    """What the head request needs to start and what the caches have; plain values."""

    request_id: int
    chunk_tokens: int          # its first chunk (prompt capped by max_prefill_tokens)
    blocks_needed: int         # KV blocks for that chunk
    num_free: int              # KV blocks an allocation may take now (free + evictable, under the cap)
    num_used: int
    num_blocks: int            # physical blocks
    cap: int | None            # the kv_blocks_cap lever (None: no cap)
    ssm_free: int
    ssm_slots: int
    whole_prompt: bool = False # the MLA whole-prompt rule: the first chunk is the whole prompt


def blocker(needs: HeadNeeds) -> str | None:
    """One line naming what stops the head request from starting, or None when it can start."""
    head = f"head request {needs.request_id}"
    if needs.ssm_free == 0:
        return f"{head} waits for an SSM slot (all {needs.ssm_slots} in use)"
    if needs.blocks_needed <= needs.num_free:
        return None
    what = (f"its whole {needs.chunk_tokens}-token prompt (MLA whole-prompt rule: mla_chunked_prefill off)"
            if needs.whole_prompt else f"its first {needs.chunk_tokens}-token chunk")
    if needs.cap is not None and needs.cap < needs.num_blocks and needs.blocks_needed > needs.cap:
        return (f"{head} needs {needs.blocks_needed} KV blocks, cap is {needs.cap} "
                f"(kv_blocks_cap lever; {what} cannot start until the cap is raised)")
    why = f" for {what}" if needs.whole_prompt else ""
    return (f"{head} needs {needs.blocks_needed} KV blocks{why}, {needs.num_free} free of "
            f"{min(needs.num_blocks, needs.cap or needs.num_blocks)} usable ({needs.num_used} in use)")


def head_needs(waiting, pools: Any, max_prefill_tokens: int, whole_prompt: bool = False) -> HeadNeeds | None:
    """The head request's needs, or None when the queue is empty."""
    if not waiting:
        return None
    head = waiting[0]
    bm, pool = pools.blocks, pools.ssm
    chunk = first_chunk_tokens(head.prompt_len, max_prefill_tokens, whole_prompt)
    return HeadNeeds(request_id=head.request_id, chunk_tokens=chunk, blocks_needed=bm.num_blocks_for(chunk),
                     num_free=bm.num_free, num_used=bm.num_used, num_blocks=bm.num_blocks, cap=bm.cap,
                     ssm_free=pool.num_free, ssm_slots=pool.num_slots, whole_prompt=whole_prompt)
