"""The frontend's side of the bridge: handlers submit and cancel, the engine's messages reach them.

Runs on the frontend's event loop only. Everything a handler sends in one loop turn leaves as
one message (so the n choices of one HTTP request reach the engine together, with consecutive
request ids); each ``Batch`` from the engine is handed out to the requests' queues at once, as
``(choice index, Tokens | Ended)``. When the engine goes away every open request ends with an
error (503) and new ones are refused.
"""
from __future__ import annotations

import asyncio
from typing import Any

from engine.api.wire import Batch, Cancel, Ended, MetricsQuery, Submit, Tokens, frame
from engine.scheduler.request_features import RequestFeatures
from telemetry import events as ev

ENGINE_GONE = "the engine process is gone"
METRICS_TIMEOUT_S = 10.0


class QueueFull(Exception):
    """More requests wait than ``--max-waiting`` allows."""


class EngineGone(Exception):
    """The engine process has exited: nothing can be served."""


class RequestIds:
    """The engine's request ids of one HTTP request's choices, filled in as the engine drains them."""

    def __init__(self, num: int) -> None:
        self.ids: list[int | None] = [None] * num
        self.known = asyncio.Event()        # set when every choice has its id (or the engine is gone)

    def set(self, index: int, request_id: int) -> None:
        self.ids[index] = request_id
        if all(i is not None for i in self.ids):
            self.known.set()

    def header(self) -> str:
        """``"17"`` / ``"17, 18"``: the value of the x-chunkscope-request-ids header."""
        return ", ".join(str(i) for i in self.ids if i is not None)


class FrontendBridge:
    def __init__(self, *, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.num_waiting = 0            # the scheduler's waiting queue, as of the engine's last message
        self._num_submitted = 0
        self._num_drained = 0           # submissions the engine has taken (the rest are on their way)
        self._outboxes: dict[int, tuple[asyncio.Queue, int]] = {}   # handle -> (its HTTP request's queue, choice)
        self._ids: dict[int, tuple[RequestIds, int]] = {}         # handle -> (its HTTP request's ids, choice)
        self._next_handle = 0
        self._pending: list[Any] = []
        self._write = None
        self._queries: dict[int, asyncio.Future] = {}
        self._next_query = 0
        self.is_engine_gone = False

    def connect(self, write) -> None:
        """``write(bytes)`` sends to the engine (a transport's write: buffered, never blocks)."""
        self._write = write

    # ---- handlers ---------------------------------------------------------------------
    def submit(self, requests: list[tuple[list[int], dict, RequestFeatures, dict | None, tuple[bytes, ...]]]
               ) -> tuple[list[int], asyncio.Queue, RequestIds]:
        """Send one HTTP request's engine requests (prompt tokens, sampling, features, grammar, images), all
        or none; returns their handles, the one queue their progress arrives in, and their request
        ids (filled in when the engine takes them)."""
        if self.is_engine_gone:
            raise EngineGone(ENGINE_GONE)
        in_flight = self._num_submitted - self._num_drained
        if self.num_waiting + in_flight + len(requests) > self.max_waiting:
            raise QueueFull(f"{self.num_waiting + in_flight} requests are waiting (--max-waiting {self.max_waiting})"
                            + (f"; this one brings {len(requests)}" if len(requests) > 1 else ""))
        outbox: asyncio.Queue = asyncio.Queue()
        ids = RequestIds(len(requests))
        handles = []
        for index, (prompt_tokens, sampling, features, grammar, images) in enumerate(requests):
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            self._outboxes[handle] = (outbox, index)
            self._ids[handle] = (ids, index)
            self._num_submitted += 1
            self._send(Submit(handle, prompt_tokens, sampling, features, grammar, images))
            handles.append(handle)
        return handles, outbox, ids

    def cancel(self, handles: list[int]) -> None:
        for handle in handles:
            self._ids.pop(handle, None)
            if self._outboxes.pop(handle, None) is not None and not self.is_engine_gone:
                self._send(Cancel(handle))

    async def metrics_families(self) -> list:
        """The engine's metric families (its counters and histograms), asked for at its next tick boundary."""
        if self.is_engine_gone:
            raise EngineGone(ENGINE_GONE)
        query_id, self._next_query = self._next_query, self._next_query + 1
        self._queries[query_id] = answer = asyncio.get_running_loop().create_future()
        self._send(MetricsQuery(query_id))
        try:
            return await asyncio.wait_for(answer, METRICS_TIMEOUT_S)
        finally:
            self._queries.pop(query_id, None)

    def _send(self, op: Any) -> None:
        self._pending.append(op)
        if len(self._pending) == 1:   # the first op of this loop turn: flush once the turn's handlers ran
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        ops, self._pending = self._pending, []
        if ops and self._write is not None and not self.is_engine_gone:
            self._write(frame(ops))

    # ---- engine messages --------------------------------------------------------------
    def on_batch(self, batch: Batch) -> None:
        self.num_waiting, self._num_drained = batch.num_waiting, batch.num_drained
        outboxes, prompt_logprobs = self._outboxes, batch.prompt_logprobs
        for handle, request_id in batch.request_ids.items():
            target = self._ids.pop(handle, None)
            if target is not None:
                target[0].set(target[1], request_id)
        for handle, token_ids, logprobs in batch.tokens:
            target = outboxes.get(handle)
            if target is not None:
                target[0].put_nowait((target[1], Tokens(token_ids, logprobs, prompt_logprobs.get(handle))))
        for handle, *fields in batch.ended:
            self._ids.pop(handle, None)
            target = outboxes.pop(handle, None)
            if target is not None:
                target[0].put_nowait((target[1], Ended(*fields)))
        for query_id, families in batch.metrics.items():
            answer = self._queries.get(query_id)
            if answer is not None and not answer.done():
                answer.set_result(families)

    def on_engine_gone(self) -> None:
        """Every open request ends with an error; the /metrics queries fail."""
        self.is_engine_gone = True
        for outbox, index in self._outboxes.values():
            outbox.put_nowait((index, Ended(ev.REQ_CANCELLED, "cancelled", ENGINE_GONE, 0, 0, None)))
        self._outboxes.clear()
        for ids, _index in self._ids.values():
            ids.known.set()             # no id will come: nobody waits for one
        self._ids.clear()
        for answer in self._queries.values():
            if not answer.done():
                answer.set_exception(EngineGone(ENGINE_GONE))
