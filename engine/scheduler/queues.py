"""Where every request is between arrival and end: the only mutable queue state of the scheduler.

``waiting`` (FIFO), the single ``prefilling`` request, the decode batch ``active``, and the ended
requests (``done``, oldest first; an endless server keeps only the newest, their rows are in
telemetry). The stages move requests between them; nothing else does.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.scheduler.request import Request


class Queues:
    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.active: list[Request] = []
        self.done: list[Request] | deque[Request] = []
        self.num_done = 0
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active)

    def mark_done(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        self.done.extend(requests)
        self.num_done += len(requests)

    def keep_recent_done(self, num: int) -> None:
        """Bound ``done`` to the newest ``num`` requests."""
        self.done = deque(self.done, maxlen=num)

    def start_decoding(self, request: Request) -> None:
        """The prefilling request got its first token: it joins the decode batch."""
        self.prefilling = None
        self.active.append(request)

    def remove_active(self, request: Request) -> None:
        self.active.remove(request)

    def retire(self) -> int:
        """Move finished or failed requests out of the batch (and the prefill); returns how many."""
        ended = [r for r in self.active if r.finished_ns is not None]
        if ended:
            self.active = [r for r in self.active if r.finished_ns is None]
        if self.prefilling is not None and self.prefilling.finished_ns is not None:
            ended.append(self.prefilling)
            self.prefilling = None
        self.mark_done(ended)
        return len(ended)
