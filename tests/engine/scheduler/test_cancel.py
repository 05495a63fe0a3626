"""``Scheduler.cancel`` and shutdown: a request ended from outside the loop is ``cancelled``, its
caches go back, and the requests around it are untouched."""
from __future__ import annotations

import pytest

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    return model


def make(tiny, rows):
    runner = ModelRunner.build(tiny, num_kv_blocks=128, num_ssm_slots=4)
    return Scheduler(runner, defaults().replace(max_prefill_tokens=16), emit=rows.append)


def alone(tiny, request):
    sched = make(tiny, [])
    sched.submit(*request)
    while sched.has_work:
        sched.step()
    return sched.done[0].output_tokens


def test_cancel_ends_waiting_prefilling_and_decoding_requests_only(tiny):
    rows: list = []
    sched = make(tiny, rows)
    requests = [(0, list(range(1, 20)), {"max_tokens": 30}), (1, list(range(2, 60)), {"max_tokens": 30}),
                (2, list(range(3, 30)), {"max_tokens": 30}), (3, list(range(4, 25)), {"max_tokens": 8})]
    for request in requests:
        sched.submit(*request)
    while not sched.active:  # request 0 decodes, request 1 prefills, 2 and 3 wait
        sched.step()
    sched.step()
    assert sched.prefilling is not None and sched.prefilling.request_id == 1
    assert 2 in [r.request_id for r in sched.waiting]
    assert sched.cancel(2, "client went away").status == ev.REQ_CANCELLED    # waiting
    assert sched.cancel(1, "client went away").request_id == 1               # prefilling
    assert sched.cancel(0, "client went away").request_id == 0               # decoding
    assert sched.cancel(0, "again") is None and sched.cancel(99, "unknown") is None
    while sched.has_work:
        sched.step()
    ended = {r.request_id: r for r in sched.done}
    assert {rid: r.status for rid, r in ended.items()} == {
        0: ev.REQ_CANCELLED, 1: ev.REQ_CANCELLED, 2: ev.REQ_CANCELLED, 3: ev.REQ_FINISHED}
    assert ended[0].error == "cancelled: client went away" and ended[0].finish_reason == "cancelled"
    assert ended[0].output_tokens and ended[0].output_tokens == alone(tiny, requests[0])[:len(ended[0].output_tokens)]
    assert ended[3].output_tokens == alone(tiny, requests[3])
    kinds = [(r.request_id, r.kind) for r in rows if isinstance(r, ev.RequestEvent) and r.kind == "cancelled"]
    assert sorted(kinds) == [(0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert sched.pools.blocks.num_used == 0 and sched.pools.ssm.num_used == 0


def test_stop_cancels_everything_in_flight(tiny):
    sched = make(tiny, [])
    for i in range(4):
        sched.submit(i, list(range(1 + i, 40 + i)), {"max_tokens": 50})
    for _ in range(6):
        sched.step()
    assert sched.active and sched.waiting
    sched.stop()
    assert not sched.has_work and len(sched.done) == 4
    assert {r.status for r in sched.done} == {ev.REQ_CANCELLED}
    assert all(r.error.startswith("cancelled: engine stopped") for r in sched.done)
    assert sched.pools.blocks.num_used == 0 and sched.pools.ssm.num_used == 0
