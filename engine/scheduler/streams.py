"""Named streams and events, each record / wait / sync reported once to telemetry.

Three streams, as in the reference scheduler: ``default`` (decode, sampling),
``prefill`` (prefill chunks) and ``secondary`` (a speculative verify's async
state copies). The reference's ordering step is: record an event on the
prefill stream, make the default stream wait on it, then sample. And before a
chunk's forward the prefill stream waits for the default stream, so the chunk
reads the state admission and the decodes left, never an older one.

On CUDA these are real ``torch.cuda.Stream`` and ``torch.cuda.Event``
objects. On CPU the host equivalent keeps the same API: a record is a host
timestamp, a wait is an ordering no-op (the host runs in order anyway) and a
sync returns at once; every call still reports, so the telemetry looks the
same on both.

Reports: ``on_event(kind, stream, event_name, seq, target_stream, gpu_elapsed_ms)``
is called exactly once per record / wait / sync. ``seq`` numbers records and
syncs in order; a wait reports the ``seq`` of the record it waits for and the
stream that record was on, with ``target_stream`` the stream made to wait.

GPU times never stall the host by default: a CUDA event's time is known only
once the GPU has passed it, so

- a record reports the GPU time since the previous record on its stream when
  both have already completed at record time (the GPU is idle), else None;
  with ``blocking_timing=True`` the record waits for its event so the time is
  always known (for profiling; it serializes host and GPU);
- a sync, which waits anyway, reports the GPU time since the stream's
  previous sync (or its first record), always available.
On CPU ``gpu_elapsed_ms`` is None: there is no GPU clock (the rows' host
timestamps already carry host timing).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

STREAM_DEFAULT = "default"
STREAM_PREFILL = "prefill"
STREAM_SECONDARY = "secondary"
STREAM_NAMES = (STREAM_DEFAULT, STREAM_PREFILL, STREAM_SECONDARY)

EVENT_PREFILL_DONE = "prefill_done"        # prefill chunk finished; default waits before sampling
EVENT_DEFAULT_DONE = "default_done"        # default stream's work so far; prefill waits before a chunk
EVENT_SECONDARY_DONE = "secondary_done"    # async state copies of the last verify finished

KIND_RECORD, KIND_WAIT, KIND_SYNC = "record", "wait", "sync"

OnEvent = Callable[[str, str, str, int, "str | None", "float | None"], None]


@dataclass
class _Recorded:
    seq: int
    stream: str
    handle: Any          # torch.cuda.Event on CUDA, host time in ns on CPU


class StreamSet:
    """The engine's streams on one device, reporting every record / wait / sync."""

    def __init__(self, device: torch.device | str, on_event: OnEvent, *, blocking_timing: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} asked for, but CUDA is not available")
        self.is_cuda = self.device.type == "cuda"
        self.blocking_timing = blocking_timing
        self._on_event = on_event
        self._seq = 0
        self._latest: dict[str, _Recorded] = {}               # event name -> its latest record
        self._last_on_stream: dict[str, _Recorded] = {}       # stream -> its latest record
        self._since_sync: dict[str, Any] = {}                 # stream -> first CUDA event since its last sync
        self.current = STREAM_DEFAULT
        self._streams: dict[str, Any] = {}
        if self.is_cuda:
            self._streams[STREAM_DEFAULT] = torch.cuda.default_stream(self.device)
            for name in (STREAM_PREFILL, STREAM_SECONDARY):
                self._streams[name] = torch.cuda.Stream(device=self.device)

    # -- helpers ---------------------------------------------------------
    @staticmethod
    def _check_stream(stream: str) -> None:
        if stream not in STREAM_NAMES:
            raise ValueError(f"stream must be one of {STREAM_NAMES}, got {stream!r}")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def torch_stream(self, stream: str) -> "torch.cuda.Stream | None":
        """The CUDA stream behind a name (None on CPU), for code that launches work itself."""
        self._check_stream(stream)
        return self._streams.get(stream)

    def _new_cuda_event(self, stream: str) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._streams[stream])
        return event

    # -- the three operations -------------------------------------------
    def record(self, event_name: str, stream: str) -> int:
        """Record ``event_name`` on ``stream``; returns the seq that a later wait will link to."""
        self._check_stream(stream)
        if not event_name:
            raise ValueError("event_name must be a non-empty string")
        seq = self._next_seq()
        elapsed_ms = None
        if self.is_cuda:
            handle = self._new_cuda_event(stream)
            self._since_sync.setdefault(stream, handle)
            previous = self._last_on_stream.get(stream)
            if self.blocking_timing:
                handle.synchronize()
            if previous is not None and previous.handle.query() and handle.query():
                elapsed_ms = previous.handle.elapsed_time(handle)
        else:
            handle = time.perf_counter_ns()
        recorded = _Recorded(seq, stream, handle)
        self._latest[event_name] = recorded
        self._last_on_stream[stream] = recorded
        self._on_event(KIND_RECORD, stream, event_name, seq, None, elapsed_ms)
        return seq

    def wait(self, target_stream: str, event_name: str) -> int:
        """Make ``target_stream`` wait for the latest record of ``event_name``; returns that record's seq."""
        self._check_stream(target_stream)
        recorded = self._latest.get(event_name)
        if recorded is None:
            raise ValueError(f"wait on event {event_name!r} before any record of it")
        if self.is_cuda:
            self._streams[target_stream].wait_event(recorded.handle)
        self._on_event(KIND_WAIT, recorded.stream, event_name, recorded.seq, target_stream, None)
        return recorded.seq

    def sync(self, stream: str, event_name: str = "sync") -> int:
        """Block the host until ``stream`` has finished its work; returns this sync's seq."""
        self._check_stream(stream)
        seq = self._next_seq()
        elapsed_ms = None
        if self.is_cuda:
            marker = self._new_cuda_event(stream)
            self._streams[stream].synchronize()
            start = self._since_sync.pop(stream, None)
            elapsed_ms = start.elapsed_time(marker) if start is not None else 0.0
            self._since_sync[stream] = marker
        self._on_event(KIND_SYNC, stream, event_name, seq, None, elapsed_ms)
        return seq

    def wait_for(self, target_stream: str, source_stream: str, event_name: str) -> int:
        """Record ``event_name`` on ``source_stream`` and make ``target_stream`` wait for it: work
        issued on the target from now on runs after everything issued on the source so far."""
        seq = self.record(event_name, source_stream)
        self.wait(target_stream, event_name)
        return seq

    @contextlib.contextmanager
    def use(self, stream: str) -> Iterator[None]:
        """Run the block's work on ``stream`` (a real stream context on CUDA)."""
        self._check_stream(stream)
        previous, self.current = self.current, stream
        try:
            if self.is_cuda:
                with torch.cuda.stream(self._streams[stream]):
                    yield
            else:
                yield
        finally:
            self.current = previous

    def host_time_ns(self, event_name: str) -> int | None:
        """CPU only: when the latest record of ``event_name`` happened (perf_counter ns)."""
        recorded = self._latest.get(event_name)
        return recorded.handle if recorded is not None and not self.is_cuda else None
