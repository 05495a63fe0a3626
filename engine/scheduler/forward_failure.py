"""A failing forward ends only its own requests, and the loop goes on (the reference's invariant).

In the reference scheduler a prefill whose forward or first-token sample fails
completes that one request with no token; nothing else stops. Here:

- a failed prefill chunk (plain or mixed) ends the prefilling request with
  status ``error``; in a mixed tick the decode rows' SSM state, snapshotted
  before the fused forward, is put back (their K/V writes sit past their cached
  length and are overwritten by their next token; the runner gives the blocks
  it allocated back), so they decode on as if the tick had not happened. When
  that restore fails, or the forward succeeded but sampling the decode rows
  failed (their caches moved on without a token), they end with an error too;
- a failed decode forward ends that batch's requests.

Every failure is one ``forward_failed`` event row (what failed, which requests
it ended, which it restored) and one log line; ending a request returns its KV
blocks and SSM slot to the pools (``endings.finish``). Under expert parallelism a
dead or hung rank (``RankFailure``) is let through: every rank runs every forward,
so the whole run ends (``serve`` marks it failed).
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence

from engine.cache.pools import CachePools
from engine.model.errors import RankFailure
from engine.scheduler.context import TickContext
from engine.scheduler.endings import finish
from engine.scheduler.request import Request
from engine.scheduler.streams import EVENT_PREFILL_DONE, STREAM_DEFAULT, STREAM_PREFILL
from telemetry import events as ev

log = logging.getLogger("chunkscope.scheduler")

STAGE_PREFILL = "prefill forward"
STAGE_MIXED = "mixed forward"
STAGE_FIRST_TOKEN = "first-token sampling"
STAGE_DECODE = "decode forward"
STAGE_MIXED_SAMPLING = "decode sampling after a mixed forward"
STAGE_RESTORE = "restoring the decode rows after a failed mixed forward"


def error_text(stage: str, exc: BaseException) -> str:
    """The ended request's error: what failed, the exception's type and message."""
    return f"{stage} failed: {type(exc).__name__}: {exc}"


def _where(exc: BaseException) -> str | None:
    """file:line of the innermost frame that raised, for the log line."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def end_requests(ctx: TickContext, pools: CachePools, requests: Sequence[Request], exc: BaseException, *,
                 stage: str, path: str, restored: Sequence[Request] = ()) -> list[Request]:
    """End the still-running ``requests`` as ``error`` naming ``exc``; one event row, one log line.

    ``restored``: requests of the same forward whose state was put back (they go on).
    Returns the requests ended here. A ``RankFailure`` (an expert-parallel rank died or hung)
    is not one forward's failure: it propagates and ends the whole run.
    """
    if isinstance(exc, RankFailure):
        raise exc
    message = error_text(stage, exc)
    ended = [r for r in requests if r.finished_ns is None]
    for request in ended:
        finish(ctx, pools, request, "error", message)
    where = _where(exc)
    ctx.event(ev.EVENT_FORWARD_FAILED, ended[0].request_id if ended else None,
              {"stage": stage, "path": path, "error_type": type(exc).__name__, "message": str(exc), "where": where,
               "ended_request_ids": [r.request_id for r in ended],
               "restored_request_ids": [r.request_id for r in restored]})
    log.error("tick %d: %s failed (%s: %s at %s); ended request(s) %s%s; the engine serves on",
              ctx.tick, stage, type(exc).__name__, exc, where, [r.request_id for r in ended],
              f", restored {[r.request_id for r in restored]}" if restored else "")
    return ended


def end_prefill(ctx: TickContext, pools: CachePools, req: Request, exc: BaseException, *, stage: str, path: str,
                restored: Sequence[Request] = ()) -> None:
    """End the prefilling request after its chunk failed.

    Work the failed chunk left on the prefill stream must finish before the default
    stream touches the blocks and the slot this frees.
    """
    ctx.streams.wait_for(STREAM_DEFAULT, STREAM_PREFILL, EVENT_PREFILL_DONE)
    end_requests(ctx, pools, [req], exc, stage=stage, path=path, restored=restored)
