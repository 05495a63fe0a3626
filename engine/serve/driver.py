"""The tick boundary every outer loop shares: serve, replay, generate and the benches.

Between two ticks the engine takes what arrived: new requests (by wall time, by recorded tick or
all at once), the API inbox, lever changes (the levers file, a recorded timeline), and cancels.
``TickDriver.tick`` runs the boundary sources in their order, then the ``before_step`` hooks, one
scheduler step when there is work, the stall watch, and each source's ``after_tick`` (the API's
outbox). A loop around it decides only how to wait: serve by the clock, replay not at all.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.serve.stall_watch import StallWatch


class Boundary(Protocol):
    """Something that reaches the scheduler only at tick boundaries."""

    def before_tick(self, sched) -> None: ...

    def after_tick(self, sched) -> None: ...


@dataclass(frozen=True)
class TickOutcome:
    ran: bool               # a tick was counted
    had_work: bool          # requests were waiting, prefilling or decoding before the step
    stalled: bool           # work waits and nothing could run (a lever, an arrival or a stop may help)
    blocker_changed: bool   # the stall's blocker is new (the heartbeat wants it at once)


class TickDriver:
    def __init__(self, sched, sources: Sequence[Boundary] = (), *, before_step: Sequence[Callable[[Any], None]] = (),
                 stall: StallWatch | None = None) -> None:
        self.sched = sched
        self.sources = list(sources)
        self.before_step = list(before_step)
        self.stall = stall

    def boundary(self) -> None:
        """What arrived since the last tick reaches the scheduler, source by source."""
        for source in self.sources:
            source.before_tick(self.sched)

    def tick(self) -> TickOutcome:
        """One boundary and (with work) one step."""
        sched = self.sched
        self.boundary()
        for hook in self.before_step:
            hook(sched)
        had_work = sched.has_work
        ran = had_work and sched.step()
        stalled = changed = False
        if had_work and self.stall is not None:
            before = self.stall.blocker
            stalled = self.stall.after_step(sched, ran)
            changed = self.stall.blocker != before
        for source in self.sources:
            source.after_tick(sched)
        return TickOutcome(ran, had_work, stalled, changed)

    def run(self) -> None:
        """Tick until nothing runs (every request ended, or nothing can start)."""
        while self.tick().ran:
            pass


# ---- sources -------------------------------------------------------------------------------------
class Source:
    """A boundary source with nothing to do after a tick."""

    def before_tick(self, sched) -> None:
        pass

    def after_tick(self, sched) -> None:
        pass


def submit_spec(sched, spec) -> Any:
    """A workload ``RequestSpec`` (or a recorded request row) into the scheduler."""
    return sched.submit(spec.request_id, list(spec.prompt_tokens), dict(spec.sampling),
                        conversation_id=spec.conversation_id, features=spec.features or None,
                        grammar=spec.grammar, grammar_ready_tick=getattr(spec, "grammar_ready_tick", None))


class TickArrivals(Source):
    """Requests that arrive at a tick (``tick_of``): a replay, or a bench's seeded workload. When the
    engine idles, idle time costs no tick: ``submit_next`` hands over the next one at once."""

    def __init__(self, specs: Iterable, tick_of: Callable[[Any], int], *, submit=submit_spec) -> None:
        self.pending = deque(specs)
        self.tick_of = tick_of
        self._submit = submit
        self.submitted: list = []    # what ``sched.submit`` returned, in submission order

    def before_tick(self, sched) -> None:
        while self.pending and self.tick_of(self.pending[0]) <= sched.tick:
            self.submit_next(sched)

    def submit_next(self, sched) -> None:
        self.submitted.append(self._submit(sched, self.pending.popleft()))


def run_arrivals(driver: TickDriver, arrivals: TickArrivals, *, cut_at_tick: int | None = None) -> None:
    """Tick through ``arrivals`` until every request ended (or, with ``cut_at_tick``, that many ticks)."""
    sched = driver.sched
    while cut_at_tick is None or sched.tick < cut_at_tick:
        if driver.tick().ran:
            continue
        if not arrivals.pending:
            break   # nothing left to arrive (work that cannot run would wait here forever)
        arrivals.submit_next(sched)


class TimedArrivals(Source):
    """A workload fed by wall time (``serve``): each request once its arrival time has come."""

    def __init__(self, feed, elapsed_s: Callable[[], float], *, new_request_id=None, on_submit=submit_spec) -> None:
        self.feed, self.elapsed_s = feed, elapsed_s
        self.new_request_id = new_request_id   # the API's id counter: workload and API ids never collide
        self._submit = on_submit

    def before_tick(self, sched) -> None:
        for spec in self.feed.due(self.elapsed_s()):
            if self.new_request_id is not None:
                spec.request_id = self.new_request_id()
            self._submit(sched, spec)


class LeverFile(Source):
    """The levers file (``serve``): each validated new version applied, a bad one rejected."""

    def __init__(self, watcher, log) -> None:
        self.watcher, self.log = watcher, log

    def before_tick(self, sched) -> None:
        update = self.watcher.poll(sched.levers)
        if update is None:
            return
        if update.error is not None:
            sched.reject_levers(update.error, source="file")
        else:
            changes = sched.apply_levers(update.values, source="file", version=update.version)
            self.log.info("levers applied at tick %d: %s", sched.tick, changes)


class LeverTimeline(Source):
    """Lever changes recorded by tick (a replay); ``flips`` win over the timeline.

    Each recorded apply is replayed as its own apply, in order: while the engine was blocked its
    tick stood still, so several applies share one tick (a KV cap set, the engine blocked, the cap
    lifted), and merging them would net the cap out and lose the stall. After each apply the
    timeline notes whether no step is possible (``blocked``: the replay's view of the stall)."""

    def __init__(self, changes: Iterable, flips: dict[str, Any]) -> None:
        self.changes = deque(changes)
        self.flips = flips
        self.log: list[dict] = []        # what was applied where, one entry per apply
        self.blocked: list[dict] = []    # {"tick", "blocker"}: no step possible after an apply

    def before_tick(self, sched) -> None:
        while self.changes and self.changes[0].tick <= sched.tick:
            due = self._next_apply()
            values = sched.levers.replace(**due).replace(**self.flips)
            applied = sched.apply_levers(values, source="replay")
            if applied:
                self.log.append({"tick": sched.tick, "changes": {k: v[1] for k, v in applied.items()}})
            if sched.waiting and not sched.active and sched.prefilling is None:
                blocker = StallWatch().head_blocker(sched)
                if blocker is not None:
                    self.blocked.append({"tick": sched.tick, "blocker": blocker})

    def _next_apply(self) -> dict[str, Any]:
        """The next recorded apply: consecutive changes of one tick, one file version and one source
        (a lever named twice starts a new apply)."""
        first = self.changes.popleft()
        due = {first.name: first.new}
        key = (first.tick, getattr(first, "file_version", None), getattr(first, "source", None))
        while self.changes:
            change = self.changes[0]
            same = (change.tick, getattr(change, "file_version", None), getattr(change, "source", None)) == key
            if not same or change.name in due:
                break
            due[self.changes.popleft().name] = change.new
        return due


class TickCancels(Source):
    """Cancels recorded by tick (API clients that went away), each ``(tick, request id)``."""

    def __init__(self, cancels: Iterable[tuple[int, int]], reason: str) -> None:
        self.cancels = deque(cancels)
        self.reason = reason

    def before_tick(self, sched) -> None:
        while self.cancels and self.cancels[0][0] <= sched.tick:
            sched.cancel(self.cancels.popleft()[1], self.reason)


class ApiInbox(Source):
    """The HTTP API (``engine/api/launch.py``): its submissions and cancels in, its tokens out."""

    def __init__(self, api) -> None:
        self.api = api

    def before_tick(self, sched) -> None:
        self.api.before_tick(sched)

    def after_tick(self, sched) -> None:
        self.api.after_tick(sched)
