"""Shared by the grammar engine tests: a tiny-model scheduler with a grammar compiler, and a driver."""
from __future__ import annotations

import random
import time

from engine.grammar.compiler import GrammarCompiler
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry.levers import defaults

_TINY: dict = {}


def tiny():
    if not _TINY:
        model, _, tokenizer = load_model("tiny")
        _TINY.update(model=model, tokenizer=tokenizer)
    return _TINY["model"], _TINY["tokenizer"]


def make_scheduler(levers=None, *, kv_blocks: int = 512, ssm_slots: int = 16, rows=None,
                   prefix_cache: bool = False, grammars: bool = True) -> Scheduler:
    """``grammars``: with the compile worker (as an engine whose checkpoint has a tokenizer)."""
    model, tokenizer = tiny()
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots)
    compiler = GrammarCompiler.for_model(model, tokenizer, runner.vocab_size) if grammars else None
    return Scheduler(runner, levers or defaults(), emit=rows.append if rows is not None else None,
                     prefix_cache=prefix_cache, grammars=compiler)


def run_to_end(sched: Scheduler, max_ticks: int = 100_000, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sched.has_work and sched.tick < max_ticks:
        if not sched.step():
            # Nothing could run: only requests waiting for their grammar's compile are left.
            assert time.monotonic() < deadline, "requests never became ready"
            time.sleep(0.002)
    runner = sched.runner
    runner.pools.blocks.check_invariants()
    runner.pools.ssm.check_invariants()


def prompt(rng: random.Random, low: int = 6, high: int = 24) -> list[int]:
    return [rng.randrange(256) for _ in range(rng.randint(low, high))]


def text_of(request) -> str:
    model, tokenizer = tiny()
    return tokenizer.decode([t for t in request.output_tokens if t != model.eos_token_id])
