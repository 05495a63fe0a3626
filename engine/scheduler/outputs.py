"""Output-token bookkeeping shared by every step that samples: record a generated token, apply the stop rules.

Its own module so the decode step and the speculative step (which calls it for each
accepted token) do not import each other.
"""
from __future__ import annotations

from engine.cache.pools import CachePools
from engine.scheduler import grammar_step
from engine.scheduler.adaptive import advance
from engine.scheduler.context import TickContext
from engine.scheduler.endings import finish
from engine.scheduler.request import Request
from engine.scheduler.request_features import find_stop_string, stop_string_window
from telemetry import events as ev


def append_token(ctx: TickContext, pools: CachePools, request: Request, token: int) -> None:
    """Record one generated token and end the request when a stop rule fires."""
    traits = ctx.traits
    index = request.num_generated
    request.output_tokens.append(token)
    request.last_token = token
    request.region = advance(request.region, token, traits.structure_tokens)
    t_ns = ctx.now_ns()
    ctx.emit(ev.TokenEvent(tick=ctx.tick, t_ns=t_ns, request_id=request.request_id, index=index, token_id=token))
    if index == 0:
        request.first_token_ns = t_ns
        ctx.emit_request(request, "first_token")
    grammar_reason, grammar_error = grammar_step.after_token(request, token)
    if grammar_error is not None:
        finish(ctx, pools, request, "error", grammar_error)
        return
    reason = finish_reason(request, token, traits.eos_ids, traits.max_context)
    if reason is None and request.features.stop_strings and traits.detokenize is not None:
        reason = _stop_string_reason(request, traits.detokenize)
    if grammar_reason is not None:
        # Complete (the last allowed token, or EOS where the grammar accepts): "stop", never
        # "length"; a grammar reply that ends any other way is incomplete.
        reason = grammar_reason
    if reason is not None:
        finish(ctx, pools, request, reason)


def _stop_string_reason(request: Request, detokenize) -> str | None:
    """"stop" when the output's newest tokens complete one of the request's stop strings.

    Checked after every token, so the first completion ends the output; only the trailing
    window that can hold a just-completed stop string is decoded (stop strings count only
    once ``min_tokens`` is met, like stop ids).
    """
    stops = request.features.stop_strings
    if request.num_generated < request.params.min_tokens:
        return None
    window = stop_string_window(stops)
    text = detokenize(request.output_tokens[-window:])
    if find_stop_string(text, stops) is None:
        return None
    request.stop_string = next(s for s in stops if s in text)
    return "stop"


def finish_reason(request: Request, token: int, eos_ids: frozenset[int] | set[int], max_context: int) -> str | None:
    """eos / stop / length, or None to keep decoding (EOS only counts once min_tokens is met)."""
    params = request.params
    if token in eos_ids and request.num_generated >= params.min_tokens:
        return "eos"
    if token in params.stop_token_ids and request.num_generated >= params.min_tokens:
        return "stop"
    if request.num_generated >= params.max_tokens:
        return "length"
    if request.prompt_len + request.num_generated >= max_context:
        return "length"
    return None
