"""A first token leaves for its client the moment the tick samples it, ahead of the other streams.

The real tiny engine and scheduler, the API's event tee and the engine's bridge on one end of a
socket pair; the test reads the other end as the frontend process would: what matters is when
and in what order messages arrive.
"""
from __future__ import annotations

import socket

from engine.api.bridge import EngineBridge
from engine.api.channel import Channel
from engine.api.launch import API
from engine.api.metrics import EngineMetrics
from engine.api.wire import Batch, Ended, Submit, Tokens, frame, unframe
from engine.serve.engine_setup import build_engine
from engine.scheduler.request_features import SOURCE_API, RequestFeatures
from telemetry.levers import defaults

SAMPLING = {"temperature": 0.0, "max_tokens": 6, "min_tokens": 6, "seed": None}


class Frontend:
    """The test's end of the socket: sends ops, reads the engine's batches."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock, self.buffer = sock, bytearray()

    def send(self, *ops) -> None:
        self.sock.sendall(frame(list(ops)))

    def batches(self) -> list[Batch]:
        try:
            while data := self.sock.recv(1 << 20):
                self.buffer += data
        except BlockingIOError:
            pass
        return unframe(self.buffer)

    def items(self, handle: int) -> list:
        return [item for batch in self.batches() for h, item in items_of(batch) if h == handle]


def items_of(batch: Batch) -> list[tuple[int, Tokens | Ended]]:
    """A batch's (handle, item) pairs in the order the frontend hands them out."""
    return ([(h, Tokens(ids, lps)) for h, ids, lps in batch.tokens] +
            [(h, Ended(*fields)) for h, *fields in batch.ended])


def test_first_token_is_sent_during_the_tick_that_samples_it():
    setup = build_engine("tiny", kv_blocks=64, ssm_slots=4, levers=defaults(), device="cpu")
    sched = setup.scheduler
    ours, theirs = socket.socketpair()
    api = API(EngineBridge(Channel(ours)), EngineMetrics("tiny"), frontend=None)
    sched.attach_telemetry(api.tee(None))
    frontend = Frontend(theirs)
    features = RequestFeatures(source=SOURCE_API)
    frontend.send(Submit(7, list(range(40, 60)), dict(SAMPLING), features))
    api.before_tick(sched)
    sent_during_tick = []
    while not sched.active:                      # prefill the first request; its token 0 comes
        sched.step()
        sent_during_tick += frontend.items(7)    # before any publish (the tick boundary)
    assert [type(item) for item in sent_during_tick] == [Tokens]
    assert sent_during_tick[0].token_ids == sched.active[0].output_tokens[:1]
    api.bridge.publish(sched)                    # nothing new for it: token 0 is not sent twice
    assert frontend.items(7) == []

    frontend.send(Submit(8, list(range(70, 90)), dict(SAMPLING), features))
    api.before_tick(sched)
    early_items, late_items = [], []
    while sched.has_work:
        sched.step()
        api.bridge.publish(sched)
        for batch in frontend.batches():         # one message per tick: both streams' news together
            early_items += [item for h, item in items_of(batch) if h == 7]
            late_items += [item for h, item in items_of(batch) if h == 8]
            assert batch.num_drained == 2
    for items, start in ((early_items, 1), (late_items, 0)):
        tokens = [t for item in items if isinstance(item, Tokens) for t in item.token_ids]
        assert isinstance(items[-1], Ended) and items[-1].output_len == 6
        assert len(tokens) == 6 - start            # every token exactly once, then the end
    done = {r.request_id: r for r in sched.done}
    assert [t for item in late_items[:-1] for t in item.token_ids] == done[1].output_tokens


def test_a_frontend_that_dies_has_its_requests_cancelled_and_pools_freed():
    setup = build_engine("tiny", kv_blocks=64, ssm_slots=4, levers=defaults(), device="cpu")
    sched = setup.scheduler
    ours, theirs = socket.socketpair()
    api = API(EngineBridge(Channel(ours)), EngineMetrics("tiny"), frontend=None)
    sched.attach_telemetry(api.tee(None))
    frontend = Frontend(theirs)
    sampling = dict(SAMPLING, max_tokens=40, min_tokens=40)
    frontend.send(Submit(0, list(range(40, 60)), sampling, RequestFeatures(source=SOURCE_API)),
                  Submit(1, list(range(60, 80)), sampling, RequestFeatures(source=SOURCE_API)))
    api.before_tick(sched)
    for _ in range(4):
        sched.step()
        api.after_tick(sched)
    assert sched.pools.ssm.num_used > 0
    theirs.close()                               # the frontend process is gone
    api.before_tick(sched)
    assert api.bridge.peer_lost and not sched.has_work
    assert sorted(r.status for r in sched.done) == ["cancelled", "cancelled"]
    assert sched.pools.ssm.num_used == 0 and sched.pools.blocks.num_used == 0
