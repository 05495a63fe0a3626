"""Stage 5 of a tick: what it did, as telemetry. The chunk's decision row is completed and emitted,
ended requests leave the batch, and the tick's row records the path, tokens, queue sizes, caches,
grammar masking and, with the machine's rates, the roofline time of its forwards."""
from __future__ import annotations

from engine.cache.pools import CachePools
from engine.model.roofline import MachineRates
from engine.model.runner import ModelRunner
from engine.scheduler.context import TickContext
from engine.scheduler.plan import KIND_CHUNK, TickPlan
from engine.scheduler.queues import Queues
from engine.scheduler.tick_output import TickOutput
from telemetry import events as ev


def _image_columns(ctx: TickContext, row: ev.ChunkDecision, covered: list, cache, request) -> None:
    """The image rows the chunk covered (``image#first-end``), the tower's time, and one event per
    encoder run or cache hit (``engine/multimodal/encoder_cache.py``) for the chunk's request."""
    if cache is None:
        return
    events = cache.take_events()
    if covered and request.seq.images is not None:
        index = {id(span): i for i, span in enumerate(request.seq.images.spans)}
        row.image_spans = " ".join(f"{index[id(c.span)]}#{c.first}-{c.end}" for c in covered)
        row.encoder_ns = sum(e.duration_ns for e in events)
    for event in events:
        kind = ev.EVENT_ENCODER_RUN if event.kind == "run" else ev.EVENT_ENCODER_HIT
        ctx.event(kind, request.request_id,
                  {"image": event.content_hash, "tokens": event.tokens, "duration_ns": event.duration_ns})


def account(plan: TickPlan, out: TickOutput, ctx: TickContext, queues: Queues, pools: CachePools,
            runner: ModelRunner, *, start_ns: int, machine_rates: MachineRates | None) -> str:
    """Emit the tick's rows; returns the path it took."""
    path, num_prefill = ev.PATH_DECODE, 0
    if plan.kind == KIND_CHUNK:
        row = out.row
        row.duration_ns = ctx.now_ns() - out.chunk_start_ns
        if row.outcome in ev.COMPUTED_OUTCOMES:
            row.ep_broadcast_ns = runner.ep_broadcast_ns  # None without expert parallelism
            row.ep_vision_sync_ns = runner.ep_vision_sync_ns  # None without image rows under it
            num_prefill = plan.chunk.chunk.length
            _image_columns(ctx, row, runner.last_image_spans, runner.encoder_cache, plan.chunk.request)
        ctx.emit(row)
        path = row.path
    num_finished = queues.retire()
    end = ctx.now_ns()
    bm, pool = pools.blocks, pools.ssm
    cost = runner.take_forward_cost()
    roofline_ns = None
    if machine_rates is not None and (cost.flops or cost.bytes):
        roofline_ns = int(machine_rates.seconds(cost) * 1e9)
    stats = ctx.grammar_stats
    ctx.emit(ev.Tick(
        tick=ctx.tick, t_ns=start_ns, path=path, duration_ns=end - start_ns,
        num_prefill_tokens=num_prefill, num_decode_tokens=out.num_decode,
        num_active=len(queues.active), num_waiting=len(queues.waiting),
        num_prefilling=int(queues.prefilling is not None), kv_blocks_used=bm.num_used,
        kv_blocks_total=bm.num_usable, ssm_slots_used=pool.num_used, ssm_slots_total=pool.num_slots,
        num_finished=num_finished, roofline_ns=roofline_ns,
        kv_bytes_used=pools.kv_bytes_used, kv_bytes_total=pools.kv_bytes_total,
        kv_tokens_used=bm.num_used * bm.block_size, kv_tokens_total=(bm.num_used + bm.num_free) * bm.block_size,
        num_constrained_rows=stats.num_rows, grammar_mask_ns=stats.mask_ns))
    return path
