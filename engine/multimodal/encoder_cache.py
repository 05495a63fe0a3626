"""The encoder cache: vision-tower outputs keyed by the image's content hash, shared by requests.

Bounded by a number of embedding rows; a request references the images of its prompt while it
prefills (``acquire`` / ``release``), and only unreferenced entries are evicted, least recently
used first. Hits and misses are counted; ``take_events`` hands the scheduler what happened since
its last call (encoder runs and hits, for telemetry).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncoderEvent:
    content_hash: str
    kind: str            # "run" (the tower ran) or "hit" (served from the cache)
    tokens: int          # embedding rows
    duration_ns: int     # the tower's time for a run, 0 for a hit


class EncoderCache:
    def __init__(self, capacity_rows: int = 4096):
        self.capacity_rows = capacity_rows
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # hash -> [tokens, hidden]
        self.refs: dict[str, int] = {}
        self.hits = self.misses = self.evictions = 0
        self.encoder_ns = 0
        self.events: list[EncoderEvent] = []

    @property
    def rows(self) -> int:
        return sum(int(e.shape[0]) for e in self.entries.values())

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self.entries

    def acquire(self, content_hash: str) -> None:
        self.refs[content_hash] = self.refs.get(content_hash, 0) + 1

    def release(self, content_hash: str) -> None:
        left = self.refs.get(content_hash, 0) - 1
        if left > 0:
            self.refs[content_hash] = left
        else:
            self.refs.pop(content_hash, None)

    def get(self, content_hash: str, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The embeddings [tokens, hidden] of an image, running ``encode`` on a miss."""
        cached = self.entries.get(content_hash)
        if cached is not None:
            self.entries.move_to_end(content_hash)
            self.hits += 1
            self.events.append(EncoderEvent(content_hash, "hit", int(cached.shape[0]), 0))
            return cached
        start = time.perf_counter_ns()
        embeds = encode()
        elapsed = time.perf_counter_ns() - start
        self.misses += 1
        self.encoder_ns += elapsed
        self.events.append(EncoderEvent(content_hash, "run", int(embeds.shape[0]), elapsed))
        self.entries[content_hash] = embeds
        self._evict()
        return embeds

    def _evict(self) -> None:
        """Drop unreferenced entries, oldest use first, until the rows fit (referenced ones stay)."""
        total = self.rows
        for key in list(self.entries):
            if total <= self.capacity_rows:
                break
            if self.refs.get(key):
                continue
            total -= int(self.entries.pop(key).shape[0])
            self.evictions += 1

    def take_events(self) -> list[EncoderEvent]:
        events, self.events = self.events, []
        return events

    def counters(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "rows": self.rows,
                "entries": len(self.entries), "encoder_ns": self.encoder_ns}
