"""Stage 1 of a tick: admission. Grammar compiles that finished let their requests compete; the
first waiting request that may start (FIFO) becomes the prefilling one when an SSM slot and the
blocks of its first chunk are free; the prefix cache attaches what it holds of its prompt.

Under the MLA whole-prompt rule (an MLA model, ``mla_chunked_prefill`` off) the first chunk is the
whole prompt, so all of its blocks must be free before it starts, and a prompt over the tick's
token budget (``max_tick_tokens``) can never start: it is rejected with the reason instead of
holding the queue."""
from __future__ import annotations

from engine.cache.pools import CachePools
from engine.cache.ssm_pool import SSMPoolExhausted
from engine.scheduler import grammar_step, prefix_step
from engine.scheduler.admission import whole_prompt_refusal
from engine.scheduler.chunk_plan import first_chunk_tokens, whole_prompt_rule
from engine.scheduler.context import TickContext
from engine.scheduler.endings import finish
from engine.scheduler.queues import Queues
from telemetry import events as ev


def admit(ctx: TickContext, queues: Queues, pools: CachePools) -> None:
    """Start the next prefill (FIFO) when an SSM slot and its first chunk's blocks are free."""
    _poll_grammars(ctx, queues, pools)
    if queues.prefilling is not None or not queues.waiting:
        return
    # FIFO among the requests that may start: one still waiting for its grammar's compile
    # does not hold back those behind it.
    head = next((r for r in queues.waiting if grammar_step.is_ready(r)), None)
    if head is None:
        return
    whole = whole_prompt_rule(ctx.traits.is_mla, ctx.levers.mla_chunked_prefill)
    refusal = whole_prompt_refusal(head.prompt_len, ctx.levers.max_tick_tokens) if whole else None
    if refusal is not None:  # it would hold the FIFO queue for good: end it, the next one may start
        queues.waiting.remove(head)
        finish(ctx, pools, head, "error", refusal, status=ev.REQ_REJECTED)
        queues.mark_done([head])
        return
    bm = pools.blocks
    # The blocks of its first chunk: under the whole-prompt rule, of the whole prompt.
    first_chunk = first_chunk_tokens(head.prompt_len, ctx.levers.max_prefill_tokens, whole)
    if pools.ssm.num_free == 0 or bm.num_free < bm.num_blocks_for(first_chunk):
        return
    index = queues.waiting.index(head)
    del queues.waiting[index]
    try:
        pools.admit(head.seq)
    except SSMPoolExhausted:  # raced by nothing today, but never lose the request
        queues.waiting.insert(index, head)
        return
    prefix_step.on_admit(ctx, pools, head)
    head.status = ev.REQ_PREFILLING
    head.admitted_ns, head.admitted_tick = ctx.now_ns(), ctx.tick
    queues.prefilling = head
    ctx.emit_request(head, "admitted")


def _poll_grammars(ctx: TickContext, queues: Queues, pools: CachePools) -> None:
    """Give each waiting request whose compile is done its matcher; end those whose compile failed."""
    for request in [r for r in queues.waiting if r.grammar_spec is not None and r.grammar is None]:
        done, error = grammar_step.take_compiled(ctx, request)
        if done and error is not None:
            queues.waiting.remove(request)
            finish(ctx, pools, request, "error", f"grammar: {error}", status=ev.REQ_REJECTED)
            queues.mark_done([request])
