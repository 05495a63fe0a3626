"""The only path between the HTTP thread and the tick loop.

HTTP handlers put submissions and cancellations into a thread-safe inbox; the serve loop
drains it at tick boundaries (``drain``) and, after each tick, hands every API request's new
tokens and its end state to that request's outbox (``publish``), an asyncio queue the
handler awaits. No handler touches the scheduler or a cache; the counts the API needs
(queue length for 429) come from a snapshot the loop publishes.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from engine.request_features import CLIENT_DISCONNECTED, RequestFeatures
from telemetry import events as ev

log = logging.getLogger("chunkscope.api")
CANCEL_REASON = CLIENT_DISCONNECTED
# How long the tick loop waits at a tick boundary for the HTTP thread to write the tick's
# first tokens: a handful of handler steps take well under a millisecond; the bound keeps a
# stalled server thread from holding up the engine.
FIRST_TOKEN_WAIT_S = 0.005


class QueueFull(Exception):
    """More requests wait than ``--max-waiting`` allows."""


@dataclass
class Outbox:
    """Where the loop sends one request's progress; lives on the server's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


def _put(items: list[tuple[Outbox, Any]]) -> None:
    for outbox, item in items:
        outbox.queue.put_nowait(item)


def _deliver(urgent: list[tuple[Outbox, Any]], rest: list[tuple[Outbox, Any]],
             written: threading.Event | None) -> None:
    """On the server's loop: wake the handlers of ``urgent`` items first; ``written`` is set once
    they have run (their steps are queued before it), then the rest are handed out."""
    _put(urgent)
    loop = asyncio.get_running_loop()
    if written is not None:
        loop.call_soon(written.set)
    if rest:
        loop.call_soon(_put, rest)


def send_all(items: list[tuple[Outbox, Any]], urgent: list[tuple[Outbox, Any]] = (),
             written: threading.Event | None = None) -> None:
    """Hand items to their outboxes with one wake-up per event loop (not one per item): a tick's
    tokens for 64 streams cost the engine thread one self-pipe write, not 64. ``urgent`` items
    (first tokens: what TTFT waits for) are handled before the others, and ``written`` is set
    once their handlers have run."""
    by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
    for batch, pairs in ((0, urgent), (1, items)):
        for outbox, item in pairs:
            by_loop.setdefault(outbox.loop, ([], []))[batch].append((outbox, item))
    for loop, (first, rest) in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, first, rest, written if first else None)
        except RuntimeError:   # the server's loop is closed (shutdown): nobody is listening
            if first and written is not None:
                written.set()


@dataclass(frozen=True)
class Tokens:
    """New output tokens (and their logprobs when asked for)."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]


@dataclass(frozen=True)
class Ended:
    status: str                  # finished / error / cancelled / rejected / preempted
    finish_reason: str | None    # eos / stop / length / error / cancelled
    error: str | None
    prompt_len: int
    output_len: int
    first_token_rules: str | None


@dataclass
class _Submit:
    handle: int
    prompt_tokens: list[int]
    sampling: dict
    features: RequestFeatures
    outbox: Outbox
    grammar: dict | None = None


@dataclass
class _Tracked:
    request: Any                 # the scheduler's Request
    outbox: Outbox
    handle: int
    num_sent: int = 0


class EngineBridge:
    """``submit`` returns a handle; the loop gives the request its id when it drains it, from the
    same counter as workload arrivals (``drain(sched, new_request_id)``), so ids follow arrival
    order across both sources."""

    def __init__(self, *, max_waiting: int) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._next_handle = 0
        self._num_queued = 0           # submitted, not yet drained into the scheduler
        self.max_waiting = max_waiting
        self.num_waiting = 0           # the scheduler's waiting queue, as of the last tick
        self._tracked: dict[int, _Tracked] = {}   # engine thread only, by request id
        self._request_id_of: dict[int, int] = {}  # engine thread only: handle -> request id
        self._wake = threading.Event()
        self._written = threading.Event()   # set once the HTTP thread has written the first tokens sent
        self._first_in_flight = False        # engine thread: first tokens sent since the last publish

    # ---- HTTP thread --------------------------------------------------------------------
    def submit(self, prompt_tokens: list[int], sampling: dict, features: RequestFeatures,
               outbox: Outbox, grammar: dict | None = None) -> int:
        """Queue a request for the next tick boundary; returns its handle (for ``cancel``)."""
        with self._lock:
            if self.num_waiting + self._num_queued >= self.max_waiting:
                raise QueueFull(f"{self.num_waiting + self._num_queued} requests are waiting "
                                f"(--max-waiting {self.max_waiting})")
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            self._num_queued += 1
        self._inbox.put(_Submit(handle, prompt_tokens, sampling, features, outbox, grammar))
        self._wake.set()
        return handle

    def cancel(self, handle: int) -> None:
        self._inbox.put(("cancel", handle))
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------
    def wait(self, timeout_s: float) -> None:
        """Idle until a submission or cancellation arrives (or the timeout)."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    def drain(self, sched, new_request_id) -> None:
        """Hand queued submissions and cancellations to the scheduler (a tick boundary)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Submit):
                with self._lock:
                    self._num_queued -= 1
                request_id = new_request_id()
                self._request_id_of[item.handle] = request_id
                request = sched.submit(request_id, item.prompt_tokens, item.sampling, features=item.features,
                                       grammar=item.grammar)
                self._tracked[request_id] = _Tracked(request, item.outbox, item.handle)
            else:
                request_id = self._request_id_of.get(item[1])
                request = sched.cancel(request_id, CANCEL_REASON) if request_id is not None else None
                if request is not None:
                    log.info("request %d cancelled at tick %d: %s after %d tokens", request.request_id,
                             sched.tick, CANCEL_REASON, request.num_generated)
        self.num_waiting = len(sched.waiting)

    def first_token(self, request_id: int) -> None:
        """A request's first token was just sampled (mid-tick): send it now, ahead of everything
        else on the HTTP thread, instead of after the rest of the tick."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.num_sent > 0:
            return
        if not self._first_in_flight:
            self._written.clear()
            self._first_in_flight = True
        send_all([], [(tracked.outbox, self._new_tokens(tracked))], self._written)

    def publish(self, sched) -> None:
        """Send each API request's new tokens, and its end, to its outbox (a tick boundary).

        When first tokens went out during the tick, the loop first waits (at most
        ``FIRST_TOKEN_WAIT_S``; usually they are written already) until the HTTP thread has
        written them: both threads need the GIL, and the next tick's Python would hold it."""
        self.num_waiting = len(sched.waiting)
        ended, first, out = [], [], []
        for request_id, tracked in self._tracked.items():
            request = tracked.request
            if len(request.output_tokens) > tracked.num_sent:
                (first if tracked.num_sent == 0 else out).append((tracked.outbox, self._new_tokens(tracked)))
            if request.finished_ns is not None:
                out.append((tracked.outbox, Ended(request.status, request.finish_reason, request.error,
                                                  request.prompt_len, tracked.num_sent, request.first_token_rules)))
                ended.append(request_id)
        if first and not self._first_in_flight:
            self._written.clear()
            self._first_in_flight = True
        if first or out:
            send_all(out, first, self._written if first else None)
        if self._first_in_flight:
            self._written.wait(FIRST_TOKEN_WAIT_S)
            self._first_in_flight = False
        for request_id in ended:
            self._request_id_of.pop(self._tracked.pop(request_id).handle, None)

    @staticmethod
    def _new_tokens(tracked: _Tracked) -> Tokens:
        request, start = tracked.request, tracked.num_sent
        tracked.num_sent = num = len(request.output_tokens)
        return Tokens(request.output_tokens[start:num], request.logprobs[start:num])

    def close(self, sched) -> None:
        """Shutdown (after ``sched.stop()``): whatever is still queued or tracked learns it ended."""
        with self._lock:
            self.max_waiting = 0       # no new submissions from now on
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Submit):
                send_all([(item.outbox, Ended(ev.REQ_CANCELLED, "cancelled", "engine stopped",
                                              len(item.prompt_tokens), 0, None))])
        self.publish(sched)
        send_all([(t.outbox, Ended(ev.REQ_CANCELLED, "cancelled", "engine stopped", t.request.prompt_len,
                                   t.num_sent, None)) for t in self._tracked.values()])
        self._tracked.clear()
