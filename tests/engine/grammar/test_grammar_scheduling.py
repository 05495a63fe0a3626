"""Grammar rules in the scheduler on the tiny model: never a preemption victim, the prefill that
finds only grammar holders fails, and n-gram speculation checks drafts against the grammar."""
from __future__ import annotations

import random
import re
import time

import pytest

from engine.scheduler.preempt import PREEMPT_POLICIES
from engine.scheduler.room import rows_that_wait
from telemetry import events as ev
from telemetry.levers import defaults

from grammar_helpers import make_scheduler, prompt, run_to_end, text_of


def run_arrivals(sched, arrivals: dict[int, list[tuple]]) -> dict[int, object]:
    """``arrivals``: tick -> [(request_id, prompt, sampling, grammar)]; runs everything to the end."""
    pending = dict(arrivals)
    submitted = {}
    while pending or sched.has_work:
        for request_id, tokens, sampling, grammar in pending.pop(sched.tick, []):
            submitted[request_id] = sched.submit(request_id, tokens, sampling, grammar=grammar)
        if not sched.step():
            if pending and not sched.has_work:
                sched.tick = min(pending)   # idle: jump to the next arrival
            else:
                time.sleep(0.002)           # only compiles pending: wait for them
    run_to_end(sched)
    assert sched.pools.blocks.num_used == 0 and sched.pools.ssm.num_used == 0
    return submitted


def holders_and_squatters(rng):
    """Two grammar holders with long prompts (they hold the most blocks), two short free requests,
    then a long prompt whose prefill needs blocks only preemption can give."""
    grammar = {"kind": "regex", "value": "[a-z]{40}"}
    return {
        0: [(0, prompt(rng, 70, 70), {"max_tokens": 48}, grammar),
            (1, prompt(rng, 70, 70), {"max_tokens": 48}, grammar),
            (2, prompt(rng, 16, 16), {"max_tokens": 40, "min_tokens": 40}, None),
            (3, prompt(rng, 16, 16), {"max_tokens": 40, "min_tokens": 40}, None)],
        12: [(4, prompt(rng, 150, 150), {"max_tokens": 4}, None)],
    }


@pytest.mark.parametrize("policy", PREEMPT_POLICIES)
def test_grammar_holders_are_never_victims_under_any_policy(policy):
    rows: list = []
    sched = make_scheduler(defaults().replace(preempt_policy=policy, max_prefill_tokens=64),
                           kv_blocks=24, ssm_slots=8, rows=rows)
    done = run_arrivals(sched, holders_and_squatters(random.Random(7)))
    preemptions = [r for r in rows if isinstance(r, ev.Preemption)]
    assert preemptions, "the KV cap never forced a preemption: the test proves nothing"
    assert not {p.victim_request_id for p in preemptions} & {0, 1}
    assert all(p.policy == policy for p in preemptions)
    assert any(p.num_grammar_skipped == 2 for p in preemptions)   # the rows say who was passed over
    for request_id in (0, 1):
        holder = done[request_id]
        assert holder.status == ev.REQ_FINISHED and holder.finish_reason == "stop"
        assert re.fullmatch("[a-z]{40}", text_of(holder)) and holder.grammar_valid
    assert {r.status for r in done.values()} <= {ev.REQ_FINISHED, ev.REQ_PREEMPTED}


def test_without_the_grammar_the_holders_would_be_the_victims():
    """The same run with no grammars: most_blocks picks the long-prompt requests (so the rule above acts)."""
    rows: list = []
    sched = make_scheduler(defaults().replace(max_prefill_tokens=64), kv_blocks=24, ssm_slots=8, rows=rows)
    arrivals = holders_and_squatters(random.Random(7))
    arrivals[0] = [(i, p, {"max_tokens": 40, "min_tokens": 40} if i < 2 else s, None) for i, p, s, _ in arrivals[0]]
    run_arrivals(sched, arrivals)
    victims = {r.victim_request_id for r in rows if isinstance(r, ev.Preemption)}
    assert victims & {0, 1}


def test_prefill_fails_when_only_grammar_holders_remain():
    """Two holders of 96-token prompts fill 14 of 16 blocks (their 15-token answers stay in block 7);
    a 120-token prompt gets its first 32-token chunk, then finds only grammar holders to preempt."""
    rows: list = []
    sched = make_scheduler(defaults().replace(max_prefill_tokens=32), kv_blocks=16, ssm_slots=4, rows=rows)
    rng = random.Random(3)
    grammar = {"kind": "regex", "value": "[a-z]{15}"}
    done = run_arrivals(sched, {
        0: [(0, prompt(rng, 96, 96), {"max_tokens": 24}, grammar),
            (1, prompt(rng, 96, 96), {"max_tokens": 24}, grammar)],
        10: [(2, prompt(rng, 120, 120), {"max_tokens": 4}, None)],
    })
    failed = done[2]
    assert failed.status == ev.REQ_ERROR and failed.error.startswith("KV cache exhausted: no request left to preempt")
    assert "2 grammar holder(s) are never preempted" in failed.error
    blocked = [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "preemption_blocked"]
    assert blocked and blocked[0].detail == {"num_grammar_skipped": 2} and blocked[0].request_id == 2
    assert not [r for r in rows if isinstance(r, ev.Preemption)]
    for request_id in (0, 1):
        assert done[request_id].finish_reason == "stop" and re.fullmatch("[a-z]{15}", text_of(done[request_id]))


SPEC_GRAMMARS = [
    {"kind": "regex", "value": "(ab|ac)+d"},
    {"kind": "json_schema", "value": {"type": "array", "items": {"enum": ["xy", "xz", "y"]}, "maxItems": 12}},
    {"kind": "choice", "value": ["abcabcabc", "abcabd"]},
    {"kind": "regex", "value": "[a-c]{0,30}"},
]


def run_one_at_a_time(levers, sampling):
    rows: list = []
    sched = make_scheduler(levers, rows=rows)
    rng = random.Random(11)
    outputs = {}
    for i, grammar in enumerate(SPEC_GRAMMARS * 2):
        request = sched.submit(i, prompt(rng, 8, 20), dict(sampling, seed=i), grammar=grammar)
        run_to_end(sched)
        outputs[i] = (request.output_tokens, request.finish_reason)
    return outputs, [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"]


@pytest.mark.parametrize("sampling", [{"max_tokens": 40}, {"max_tokens": 40, "temperature": 1.0}],
                         ids=["greedy", "seeded"])
def test_ngram_speculation_equals_off_under_a_grammar(sampling):
    off, _ = run_one_at_a_time(defaults(), sampling)
    ngram, steps = run_one_at_a_time(defaults().replace(speculation="ngram"), sampling)
    assert ngram == off
    assert sum(s.detail["num_accepted"] for s in steps) > 0, "no draft was ever accepted"
    assert any(s.detail["rolled_back"] for s in steps), "verification never rejected a draft"


def test_room_gives_free_blocks_to_the_oldest_rows_first():
    assert rows_that_wait([1, 0, 1, 1], [5, 1, 2, 3], num_free=1) == [0, 3]
    assert rows_that_wait([1, 1], [0, 0], num_free=2) == []
    assert rows_that_wait([0, 0], [0, 0], num_free=0) == []
    with pytest.raises(ValueError):
        rows_that_wait([1], [0, 1], num_free=0)


def test_holders_that_cannot_all_grow_wait_instead_of_failing_the_batch():
    """Three holders whose answers need 15 blocks in a 10-block cache: rows wait for blocks, the
    engine never raises, and only a true deadlock ends one holder (with an error, never a preemption)."""
    rows: list = []
    sched = make_scheduler(kv_blocks=10, ssm_slots=4, rows=rows)
    rng = random.Random(5)
    grammar = {"kind": "regex", "value": "[a-z]{40}"}
    done = run_arrivals(sched, {0: [(i, prompt(rng, 30, 30), {"max_tokens": 48}, grammar) for i in range(3)]})
    waits = [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "decode_rows_wait"]
    assert waits, "no row ever had to wait: the test proves nothing"
    assert not [r for r in rows if isinstance(r, ev.Preemption)]
    finished = [r for r in done.values() if r.status == ev.REQ_FINISHED]
    assert finished and all(re.fullmatch("[a-z]{40}", text_of(r)) and r.finish_reason == "stop" for r in finished)
    for request in done.values():
        if request.status != ev.REQ_FINISHED:
            assert request.status == ev.REQ_ERROR and "every sequence left holds a grammar" in request.error
