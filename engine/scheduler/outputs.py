"""Output-token bookkeeping shared by every step that samples: record a generated token, apply the stop rules.

Its own module so the decode step and the speculative step (which calls it for each
accepted token) do not import each other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler import grammar_step
from engine.scheduler.request_features import find_stop_string, stop_string_window
from engine.scheduler.adaptive import advance
from engine.scheduler.request import Request
from telemetry import events as ev

if TYPE_CHECKING:
    from engine.scheduler.loop import Scheduler


def append_token(sched: Scheduler, request: Request, token: int) -> None:
    """Record one generated token and end the request when a stop rule fires."""
    index = request.num_generated
    request.output_tokens.append(token)
    request.last_token = token
    request.region = advance(request.region, token, sched.structure_tokens)
    t_ns = sched.now_ns()
    sched.emit(ev.TokenEvent(tick=sched.tick, t_ns=t_ns, request_id=request.request_id,
                             index=index, token_id=token))
    if index == 0:
        request.first_token_ns = t_ns
        sched.emit_request(request, "first_token")
    grammar_reason, grammar_error = grammar_step.after_token(request, token)
    if grammar_error is not None:
        sched.finish(request, "error", grammar_error)
        return
    reason = finish_reason(request, token, sched.eos_ids, sched.max_context)
    if reason is None and request.features.stop_strings and sched.detokenize is not None:
        reason = _stop_string_reason(request, sched.detokenize)
    if grammar_reason is not None:
        # Complete (the last allowed token, or EOS where the grammar accepts): "stop", never
        # "length"; a grammar reply that ends any other way is incomplete.
        reason = grammar_reason
    if reason is not None:
        sched.finish(request, reason)


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


def finish_reason(request: Request, token: int, eos_ids: set[int], max_context: int) -> str | None:
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
