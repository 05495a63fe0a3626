"""The scheduler's side of grammar-constrained decoding: wait for compiles, mask rows, advance, end.

- At submit a request's grammar goes to the compile worker (``engine/grammar/compiler.py``);
  the request waits in the queue, and is not admitted, until its compile is done
  (``take_compiled``, polled by the admit stage). A compile error ends it as rejected, naming
  the problem. The tick at which the grammar was seen ready is recorded with the request; a
  replay waits for the compile until that same tick, so its decisions match.
- Every sampling site (decode, mixed decode rows, first token, speculative rows) passes its
  logits through ``constrain``, which also counts the tick's constrained rows and mask time.
- ``after_token`` advances the matcher with each generated token: a complete grammar
  ends the request with ``stop``; a token the grammar refuses (impossible under the mask,
  but a failed matcher is reported, not hidden) ends it with an error.
"""
from __future__ import annotations

import json
import time
from typing import Any

import torch

from engine.grammar import masks
from engine.grammar.compiler import GrammarCompileError
from engine.grammar.spec import JSON_KINDS, GrammarSpec, GrammarSpecError
from engine.scheduler.admission import RequestRejected
from engine.scheduler.context import TickContext
from engine.scheduler.request import Request

REASON_GRAMMAR_DONE = "stop"   # a complete grammar ends the reply like a stop sequence (OpenAI's word)


def attach(grammars, request: Request, raw: Any, ready_tick: int | None) -> None:
    """Check ``raw`` and start compiling it on ``grammars`` (the compile worker, None without a
    tokenizer); RequestRejected names the problem."""
    if grammars is None:
        raise RequestRejected("grammar: this engine has no grammar support (the model has no tokenizer.json)")
    try:
        spec = GrammarSpec.parse(raw)
    except GrammarSpecError as exc:
        raise RequestRejected(str(exc)) from None
    request.grammar_spec = spec
    request.has_grammar = True
    request.grammar_ready_tick = ready_tick
    request.grammar_future = grammars.submit(spec)


def is_ready(request: Request) -> bool:
    """May this waiting request be admitted (no grammar, or its grammar compiled)?"""
    return request.grammar_spec is None or request.grammar is not None


def take_compiled(ctx: TickContext, request: Request) -> tuple[bool, str | None]:
    """A waiting request's compile, if it is done: (done, error). Done without an error gives the
    request its matcher; a replay counts it done exactly at the recorded tick (waiting for the
    worker if it lags)."""
    future = request.grammar_future
    if request.grammar_ready_tick is not None:
        if ctx.tick < request.grammar_ready_tick:
            return False, None
    elif not future.done():
        return False, None
    request.grammar_ready_tick = ctx.tick
    request.grammar_future = None
    try:
        compiled = future.result()
    except GrammarCompileError as exc:
        return True, str(exc)
    except Exception as exc:   # llguidance raising on a pathological grammar: the request's fault
        return True, f"{request.grammar_spec.kind} grammar: {exc}"
    request.grammar = ctx.grammars.new_state(compiled, request.grammar_spec)
    request.grammar_approximations = compiled.approximations
    ctx.emit_request(request, "grammar_ready", f"{compiled.spec.kind}, compiled in {compiled.compile_ns / 1e6:.2f} ms")
    return True, None


def constrain(ctx: TickContext, batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with each constrained row masked; the tick's grammar counters grow."""
    logits, stats = masks.constrain(logits, [r.grammar for r in batch])
    ctx.grammar_stats.num_rows += stats.num_rows
    ctx.grammar_stats.mask_ns += stats.mask_ns
    return logits


def first_token_allowed(ctx: TickContext, request: Request) -> list[int] | None:
    """Token ids the grammar allows at token 0, or None when it does not constrain token 0."""
    state = request.grammar
    if state is None or not state.is_active:
        return None
    start = time.perf_counter_ns()
    mask = state.allowed_mask()
    ctx.grammar_stats.mask_ns += time.perf_counter_ns() - start
    if mask is None:
        return None
    ctx.grammar_stats.num_rows += 1
    return torch.nonzero(mask).flatten().tolist()


def is_thinking(request: Request) -> bool:
    """The request's grammar waits for ``</think>``: token 0 opens a thought (first-token policy)."""
    return request.grammar is not None and not request.grammar.is_active


def after_token(request: Request, token: int) -> tuple[str | None, str | None]:
    """Advance the request's matcher with ``token``: (finish reason, error) when the grammar ends it."""
    state = request.grammar
    if state is None:
        return None, None
    if not state.advance(token):
        return "error", f"grammar: {state.failure}"
    if state.is_stopped:
        return REASON_GRAMMAR_DONE, None
    return None, None


def output_validates(request: Request) -> bool | None:
    """Did the output end as a complete sentence of its grammar (and, for JSON, parse)?"""
    state = request.grammar
    if state is None:
        return None
    if not state.is_accepting:
        return False
    if request.grammar_spec.kind in JSON_KINDS:
        body = [t for t in request.output_tokens if t != state.tokenizer.eos_token]
        try:
            json.loads(state.tokenizer.decode_bytes(_answer_tokens(request, body)))
        except ValueError:
            return False
    return True


def _answer_tokens(request: Request, tokens: list[int]) -> list[int]:
    """The constrained part of the output: after ``</think>`` when the grammar starts there."""
    state = request.grammar
    if state.start_after is not None and state.start_after in tokens:
        return tokens[tokens.index(state.start_after) + 1:]
    return tokens
