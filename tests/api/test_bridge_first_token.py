"""A first token leaves for its client the moment the tick samples it, ahead of the other streams.

The real tiny engine and scheduler, the API's event tee and bridge, and an asyncio loop in a
thread standing in for the HTTP server (no sockets): what matters is when and in what order
items reach the outboxes.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine.api.bridge import EngineBridge, Ended, Outbox, Tokens
from engine.api.launch import API
from engine.api.metrics import EngineMetrics
from engine.engine_setup import build_engine
from engine.request_features import SOURCE_API, RequestFeatures
from telemetry.levers import defaults

SAMPLING = {"temperature": 0.0, "max_tokens": 6, "min_tokens": 6, "seed": None}


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def received(loop, outbox: Outbox) -> list:
    """What the outbox holds now (read on the loop's own thread)."""
    async def drain():
        items = []
        while not outbox.queue.empty():
            items.append(outbox.queue.get_nowait())
        return items
    return asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=5)


def test_first_token_is_sent_during_the_tick_that_samples_it(loop):
    setup = build_engine("tiny", kv_blocks=64, ssm_slots=4, levers=defaults(), device="cpu")
    sched = setup.scheduler
    api = API(EngineBridge(max_waiting=8), EngineMetrics("tiny"), server=None, info=None)
    sched.attach_telemetry(api.tee(None))
    early, late = Outbox(loop), Outbox(loop)
    features = RequestFeatures(source=SOURCE_API)
    api.bridge.submit(list(range(40, 60)), dict(SAMPLING), features, early)
    api.before_tick(sched)
    sent_during_tick = []
    while not sched.active:                      # prefill the first request; its token 0 comes
        sched.step()
        sent_during_tick += received(loop, early)   # before any publish (the tick boundary)
    assert [type(item) for item in sent_during_tick] == [Tokens]
    assert sent_during_tick[0].token_ids == sched.active[0].output_tokens[:1]
    api.bridge.publish(sched)                    # nothing new for it: token 0 is not sent twice
    assert received(loop, early) == []

    api.bridge.submit(list(range(70, 90)), dict(SAMPLING), features, late)
    api.before_tick(sched)
    while sched.has_work:
        sched.step()
        api.bridge.publish(sched)
    early_items, late_items = received(loop, early), received(loop, late)
    for items, start in ((early_items, 1), (late_items, 0)):
        tokens = [t for item in items if isinstance(item, Tokens) for t in item.token_ids]
        assert isinstance(items[-1], Ended) and items[-1].output_len == 6
        assert len(tokens) == 6 - start            # every token exactly once, then the end
    done = {r.request_id: r for r in sched.done}
    assert [t for item in late_items[:-1] for t in item.token_ids] == done[1].output_tokens
