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
# How long the tick loop waits for the HTTP thread to write a tick's first tokens: a handful
# of handler steps take well under a millisecond; the bound keeps a stalled server thread
# from holding up the engine.
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
    they have run (their step is queued before it), then the rest are handed out."""
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
    (first tokens: what TTFT waits for) are handled before the others; ``written`` is set when
    their handlers have run."""
    by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
    for batch, pairs in ((0, urgent), (1, items)):
        for outbox, item in pairs:
            by_loop.setdefault(outbox.loop, ([], []))[batch].append((outbox, item))
    for loop, (first, rest) in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, first, rest, written if first else None)
        except RuntimeError:   # the server's loop is closed (shutdown): nobody is listening
            pass


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
        self._written = threading.Event()   # the HTTP thread wrote the first tokens sent

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

    def publish(self, sched) -> None:
        """Send each API request's new tokens, and its end, to its outbox.

        When a request's first token is among them, the loop waits (at most ``FIRST_TOKEN_WAIT_S``)
        until the HTTP thread has written it: both threads need the GIL, and a first token queued
        behind 64 streams' tokens, or behind the next tick's Python, is what TTFT would pay."""
        self.num_waiting = len(sched.waiting)
        ended, first, out = [], [], []
        for request_id, tracked in self._tracked.items():
            request = tracked.request
            num = len(request.output_tokens)
            if num > tracked.num_sent:
                (first if tracked.num_sent == 0 else out).append(
                    (tracked.outbox, Tokens(request.output_tokens[tracked.num_sent:num],
                                            request.logprobs[tracked.num_sent:num])))
                tracked.num_sent = num
            if request.finished_ns is not None:
                out.append((tracked.outbox, Ended(request.status, request.finish_reason, request.error,
                                                  request.prompt_len, num, request.first_token_rules)))
                ended.append(request_id)
        if first:
            self._written.clear()
            send_all(out, first, self._written)
            self._written.wait(FIRST_TOKEN_WAIT_S)
        elif out:
            send_all(out)
        for request_id in ended:
            self._request_id_of.pop(self._tracked.pop(request_id).handle, None)

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
