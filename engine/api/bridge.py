"""The only path between the API frontend and the tick loop (the engine's side).

The frontend process sends submissions, cancellations and /metrics queries over a socket
(``engine/api/wire.py``); the serve loop takes them at tick boundaries (``drain``) and, after
each tick, sends every API request's new tokens and its end in one message (``publish``). A
first token goes out the moment it is sampled (``first_token``), ahead of the rest of the tick.
No frontend code touches the scheduler or a cache; the counts the API needs (queue length for
429) travel with each message. Each drained submission's request id goes back at once, so the
client can find its request on the dashboard (``engine/api/choices.py``).

When the frontend goes away (killed, crashed), ``drain`` cancels every API request it held
(status cancelled, pools freed) and sets ``peer_lost``; the supervisor starts a new one.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.api.channel import Channel
from engine.api.wire import Batch, Cancel, MetricsQuery, Submit
from engine.scheduler.request_features import CLIENT_DISCONNECTED
from telemetry import events as ev

log = logging.getLogger("chunkscope.api")
CANCEL_REASON = CLIENT_DISCONNECTED
FRONTEND_GONE = "the API frontend process exited"


@dataclass
class _Tracked:
    request: Any                 # the scheduler's Request
    handle: int
    num_sent: int = 0


class EngineBridge:
    """Request ids come from the loop's counter when a submission is drained
    (``drain(sched, new_request_id)``), so ids follow arrival order across API and workload."""

    def __init__(self, channel: Channel | None, collect_metrics: Callable[[], list] = list) -> None:
        self.channel = channel
        self._collect_metrics = collect_metrics
        self._tracked: dict[int, _Tracked] = {}    # by request id
        self._request_id_of: dict[int, int] = {}   # handle -> request id
        self._num_drained = 0                      # submissions taken from this frontend so far
        self._queries: list[int] = []              # /metrics queries to answer at the next publish
        self._sent_counts = (-1, -1)                # (num_waiting, num_drained) last told the frontend
        self.peer_lost = False
        self._notices: list[Any] = []              # the frontend's Ready / Failed messages

    def attach(self, channel: Channel | None) -> None:
        """A new frontend (after a restart): it starts with no requests and counts from zero."""
        self.channel, self.peer_lost = channel, False
        self._num_drained, self._sent_counts, self._queries = 0, (-1, -1), []

    def wait(self, timeout_s: float) -> None:
        """Idle until the frontend sends something (or the timeout)."""
        if self.channel is None or self.channel.is_closed:
            time.sleep(timeout_s)
        else:
            self.channel.wait(timeout_s)

    def drain(self, sched, new_request_id: Callable[[], int]) -> None:
        """Hand the frontend's submissions and cancellations to the scheduler (a tick boundary)."""
        channel = self.channel
        if channel is None or self.peer_lost:
            return
        new_ids: dict[int, int] = {}     # handle -> request id, told to the frontend at once
        for message in channel.receive():
            if not isinstance(message, list):
                self._notices.append(message)
                continue
            for op in message:
                if isinstance(op, Submit):
                    self._num_drained += 1
                    request_id = new_request_id()
                    self._request_id_of[op.handle] = request_id
                    if op.images and sched.images is not None:
                        for data in op.images:
                            sched.images.store.put(data)
                    request = sched.submit(request_id, op.prompt_tokens, op.sampling, features=op.features,
                                           grammar=op.grammar)
                    self._tracked[request_id] = _Tracked(request, op.handle)
                    new_ids[op.handle] = request_id
                elif isinstance(op, Cancel):
                    self._cancel(sched, self._request_id_of.get(op.handle), CANCEL_REASON)
                elif isinstance(op, MetricsQuery):
                    self._queries.append(op.query_id)
        if new_ids and not channel.is_closed:
            # Before any token: a streamed response's headers wait for its request ids.
            counts = (len(sched.waiting), self._num_drained)
            channel.send(Batch(num_waiting=counts[0], num_drained=counts[1], request_ids=new_ids))
            self._sent_counts = counts
        if channel.is_closed or channel.is_stuck:
            self._lose_peer(sched)

    def take_notices(self) -> list[Any]:
        notices, self._notices = self._notices, []
        return notices

    def _cancel(self, sched, request_id: int | None, reason: str) -> None:
        request = sched.cancel(request_id, reason) if request_id is not None else None
        if request is not None:
            log.info("request %d cancelled at tick %d: %s after %d tokens", request.request_id,
                     sched.tick, reason, request.num_generated)

    def _lose_peer(self, sched) -> None:
        """Every API request the frontend held is cancelled: nobody can receive its tokens."""
        log.error("%s; cancelling its %d requests", FRONTEND_GONE, len(self._tracked))
        for request_id in list(self._tracked):
            self._cancel(sched, request_id, FRONTEND_GONE)
        self._tracked.clear()
        self._request_id_of.clear()
        self.peer_lost = True

    def first_token(self, request_id: int) -> None:
        """A request's first token was just sampled (mid-tick): send it now, not after the tick."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.num_sent > 0 or self.channel is None:
            return
        prompt_logprobs = self._prompt_logprobs(tracked)
        self.channel.send(Batch([self._new_tokens(tracked)], [], max(self._sent_counts[0], 0), self._num_drained,
                                prompt_logprobs=prompt_logprobs))

    def publish(self, sched) -> None:
        """Send each API request's new tokens and its end, the queue snapshot and /metrics answers,
        as one message (a tick boundary)."""
        if self.channel is None or self.peer_lost:
            return
        first, more, ended, done, prompt_logprobs = [], [], [], [], {}
        for request_id, tracked in self._tracked.items():
            request = tracked.request
            if len(request.output_tokens) > tracked.num_sent:
                if tracked.num_sent == 0:
                    prompt_logprobs.update(self._prompt_logprobs(tracked))
                    first.append(self._new_tokens(tracked))
                else:
                    more.append(self._new_tokens(tracked))
            if request.finished_ns is not None:
                ended.append((tracked.handle, request.status, request.finish_reason, request.error,
                              request.prompt_len, tracked.num_sent, request.first_token_rules))
                done.append(request_id)
        counts = (len(sched.waiting), self._num_drained)
        metrics = {query_id: self._collect_metrics() for query_id in self._queries} if self._queries else {}
        if first or more or ended or metrics or counts != self._sent_counts:
            self.channel.send(Batch(first + more, ended, *counts, metrics, prompt_logprobs))
            self._sent_counts = counts
        self._queries = []
        for request_id in done:
            self._request_id_of.pop(self._tracked.pop(request_id).handle, None)

    @staticmethod
    def _prompt_logprobs(tracked: _Tracked) -> dict[int, list]:
        """{handle: the prompt's logprobs} for a request that asked for them (sent with its first tokens)."""
        request = tracked.request
        return {tracked.handle: request.prompt_logprobs} if request.features.prompt_logprobs is not None else {}

    @staticmethod
    def _new_tokens(tracked: _Tracked) -> tuple[int, list[int], list]:
        request, start = tracked.request, tracked.num_sent
        tracked.num_sent = num = len(request.output_tokens)
        return tracked.handle, request.output_tokens[start:num], request.logprobs[start:num]

    def close(self, sched) -> None:
        """Shutdown (after ``sched.stop()``): every tracked request learns it ended."""
        self.publish(sched)
        if self.channel is not None and self._tracked:
            self.channel.send(Batch(ended=[(t.handle, ev.REQ_CANCELLED, "cancelled", "engine stopped",
                                            t.request.prompt_len, t.num_sent, None) for t in self._tracked.values()]))
        self._tracked.clear()
