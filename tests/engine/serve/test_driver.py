"""The tick-boundary driver shared by serve, replay, generate and the benches: its order, its sources,
and a real run through it equal to the hand-written loop it replaced."""
from __future__ import annotations

import logging
from collections import deque
from types import SimpleNamespace

import pytest

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from engine.serve.driver import (ApiInbox, LeverFile, LeverTimeline, TickArrivals, TickCancels, TickDriver,
                                 TimedArrivals, run_arrivals, submit_spec)
from engine.serve.stall_watch import StallWatch
from engine.workload.request import RequestSpec
from telemetry.levers import defaults


class FakeScheduler:
    """Records what the driver asks of it; ``step`` runs while ``work`` lasts."""

    def __init__(self, work: int = 0, can_run: bool = True) -> None:
        self.log: list = []
        self.work, self.can_run = work, can_run
        self.tick = 0
        self.levers = defaults()
        self.waiting, self.prefilling = deque(), None

    @property
    def has_work(self) -> bool:
        return self.work > 0

    def step(self) -> bool:
        self.log.append("step")
        if not self.can_run:
            return False
        self.work -= 1
        self.tick += 1
        return True

    def submit(self, request_id, prompt, sampling, **kw):
        self.log.append(("submit", request_id, self.tick))
        self.work += 1
        return SimpleNamespace(request_id=request_id, status="waiting", error=None)

    def cancel(self, request_id, reason):
        self.log.append(("cancel", request_id, reason, self.tick))

    def apply_levers(self, values, *, source, version=None):
        changes = values.changes_from(self.levers)
        self.levers = values
        self.log.append(("levers", source, {k: v[1] for k, v in changes.items()}, self.tick))
        return changes

    def reject_levers(self, reason, *, source):
        self.log.append(("rejected", reason, source))

    def emit(self, event):
        self.log.append(("event", event.kind))

    def now_ns(self):
        return 0


class Recorder:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def before_tick(self, sched) -> None:
        self.log.append(("before", self.name))

    def after_tick(self, sched) -> None:
        self.log.append(("after", self.name))


def spec(request_id: int, tick: int = 0, arrival_s: float = 0.0) -> RequestSpec:
    return RequestSpec(request_id=request_id, arrival_s=arrival_s, prompt_tokens=[1, 2, 3],
                       sampling={"max_tokens": 2}, arrival_tick=tick)


def test_a_tick_runs_sources_then_hooks_then_one_step_then_after_tick():
    sched = FakeScheduler(work=1)
    driver = TickDriver(sched, [Recorder("a", sched.log), Recorder("b", sched.log)],
                        before_step=[lambda s: s.log.append("hook")])
    outcome = driver.tick()
    assert sched.log == [("before", "a"), ("before", "b"), "hook", "step", ("after", "a"), ("after", "b")]
    assert outcome.ran and outcome.had_work and not outcome.stalled


def test_no_step_without_work_and_run_stops_when_nothing_ran():
    sched = FakeScheduler(work=0)
    outcome = TickDriver(sched).tick()
    assert "step" not in sched.log and not outcome.ran and not outcome.had_work
    sched = FakeScheduler(work=3)
    TickDriver(sched).run()
    assert sched.log.count("step") == 3 and sched.tick == 3


def test_a_stalled_step_is_reported_once_per_blocker(caplog):
    sched = FakeScheduler(work=1, can_run=False)
    sched.runner = None
    stall = StallWatch()
    stall.head_blocker = lambda s: "head request 0 needs 8 KV blocks"
    driver = TickDriver(sched, stall=stall)
    with caplog.at_level(logging.WARNING, logger="chunkscope.serve"):
        first, second = driver.tick(), driver.tick()
    assert first.stalled and first.blocker_changed
    assert second.stalled and not second.blocker_changed
    assert [e for e in sched.log if isinstance(e, tuple) and e[0] == "event"] == [("event", "stalled")]
    sched.can_run = True
    cleared = driver.tick()
    assert cleared.ran and not cleared.stalled and cleared.blocker_changed
    assert sched.log[-1] == ("event", "stall_cleared")


def test_tick_arrivals_come_at_their_tick_and_at_once_when_idle():
    sched = FakeScheduler()
    arrivals = TickArrivals([spec(0, 0), spec(1, 0), spec(2, 2), spec(3, 9)], lambda s: s.arrival_tick)
    run_arrivals(TickDriver(sched, [arrivals]), arrivals)
    submits = [e for e in sched.log if isinstance(e, tuple) and e[0] == "submit"]
    # 0 and 1 at tick 0; 2 at its tick; 3 was due at tick 9, but the engine idled from tick 3: it comes then.
    assert submits == [("submit", 0, 0), ("submit", 1, 0), ("submit", 2, 2), ("submit", 3, 3)]
    assert [r.request_id for r in arrivals.submitted] == [0, 1, 2, 3]
    assert not arrivals.pending and sched.tick == 4


def test_run_arrivals_stops_at_the_cut():
    sched = FakeScheduler(work=100)
    arrivals = TickArrivals([], lambda s: s.arrival_tick)
    run_arrivals(TickDriver(sched, [arrivals]), arrivals, cut_at_tick=7)
    assert sched.tick == 7


def test_lever_timeline_applies_each_ticks_changes_together_and_flips_win():
    sched = FakeScheduler(work=10)
    changes = [SimpleNamespace(tick=1, name="max_prefill_tokens", new=32),
               SimpleNamespace(tick=1, name="bisect_no_mix", new=True),
               SimpleNamespace(tick=3, name="max_prefill_tokens", new=64)]
    timeline = LeverTimeline(changes, {"bisect_no_mix": False})
    driver = TickDriver(sched, [timeline])
    for _ in range(5):
        driver.tick()
    levers = [e for e in sched.log if isinstance(e, tuple) and e[0] == "levers"]
    assert levers == [("levers", "replay", {"max_prefill_tokens": 32}, 1),
                      ("levers", "replay", {"max_prefill_tokens": 64}, 3)]
    assert timeline.log == [{"tick": 1, "changes": {"max_prefill_tokens": 32}},
                            {"tick": 3, "changes": {"max_prefill_tokens": 64}}]


def test_applies_at_one_tick_are_replayed_one_by_one_never_netted_out():
    """While the engine was blocked its tick stood still: cap 8 (file v1), a flip (v2), the cap lifted
    (v3), all at tick 1. Merged into one apply the cap nets out and the stall vanishes (issue 29)."""
    sched = FakeScheduler(work=10)
    changes = [SimpleNamespace(tick=1, name="kv_blocks_cap", new=8, file_version=1, source="file"),
               SimpleNamespace(tick=1, name="bisect_no_mix", new=True, file_version=2, source="file"),
               SimpleNamespace(tick=1, name="max_prefill_tokens", new=64, file_version=2, source="file"),
               SimpleNamespace(tick=1, name="kv_blocks_cap", new=0, file_version=3, source="file"),
               SimpleNamespace(tick=1, name="kv_blocks_cap", new=4, file_version=None, source="dashboard"),
               SimpleNamespace(tick=1, name="kv_blocks_cap", new=0, file_version=None, source="dashboard")]
    timeline = LeverTimeline(changes, {})
    driver = TickDriver(sched, [timeline])
    driver.tick()
    driver.tick()
    assert [e["changes"] for e in timeline.log] == [{"kv_blocks_cap": 8}, {"bisect_no_mix": True,
                                                    "max_prefill_tokens": 64}, {"kv_blocks_cap": 0},
                                                    {"kv_blocks_cap": 4}, {"kv_blocks_cap": 0}]
    assert sum(len(e["changes"]) for e in timeline.log) == len(changes) and timeline.blocked == []


def test_tick_cancels_come_at_their_tick():
    sched = FakeScheduler(work=5)
    driver = TickDriver(sched, [TickCancels([(2, 7), (2, 8), (4, 9)], "client disconnected")])
    for _ in range(5):
        driver.tick()
    cancels = [e for e in sched.log if isinstance(e, tuple) and e[0] == "cancel"]
    assert cancels == [("cancel", 7, "client disconnected", 2), ("cancel", 8, "client disconnected", 2),
                       ("cancel", 9, "client disconnected", 4)]


def test_timed_arrivals_follow_the_clock_and_take_the_apis_ids():
    clock = {"s": 0.0}
    feed = SimpleNamespace(pending=deque([spec(0, arrival_s=0.0), spec(1, arrival_s=1.5)]))
    feed.due = lambda elapsed: [feed.pending.popleft() for _ in range(sum(s.arrival_s <= elapsed
                                                                          for s in feed.pending))]
    ids = iter([100, 101])
    sched = FakeScheduler()
    driver = TickDriver(sched, [TimedArrivals(feed, lambda: clock["s"], new_request_id=lambda: next(ids))])
    driver.boundary()
    clock["s"] = 1.0
    driver.boundary()
    clock["s"] = 2.0
    driver.boundary()
    assert [e[1] for e in sched.log if isinstance(e, tuple) and e[0] == "submit"] == [100, 101]


def test_the_levers_file_source_applies_a_version_or_rejects_it():
    sched = FakeScheduler()
    updates = deque([None, SimpleNamespace(error="levers.json: bad JSON", values=None, version=2),
                     SimpleNamespace(error=None, values=defaults().replace(max_prefill_tokens=8), version=3)])
    watcher = SimpleNamespace(poll=lambda current: updates.popleft())
    source = LeverFile(watcher, logging.getLogger("test"))
    for _ in range(3):
        source.before_tick(sched)
    assert sched.log == [("rejected", "levers.json: bad JSON", "file"),
                         ("levers", "file", {"max_prefill_tokens": 8}, 0)]


def test_the_api_inbox_brackets_the_step():
    log: list = []
    api = SimpleNamespace(before_tick=lambda s: log.append("drain"), after_tick=lambda s: log.append("publish"))
    sched = FakeScheduler(work=1)
    sched.step = lambda: log.append("step") or True
    TickDriver(sched, [ApiInbox(api)]).tick()
    assert log == ["drain", "step", "publish"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")[0]


def test_a_real_run_through_the_driver_equals_the_inline_loop(tiny):
    """The loop replay and the benches inlined before the driver existed gives the same ticks and tokens."""
    specs = [RequestSpec(request_id=i, arrival_s=0.0, prompt_tokens=[(7 * i + j) % 250 for j in range(20 + 9 * i)],
                         sampling={"max_tokens": 6 + i}, arrival_tick=3 * i) for i in range(6)]

    def fresh():
        return Scheduler(ModelRunner.build(tiny, num_kv_blocks=16, num_ssm_slots=3),
                         defaults().replace(max_prefill_tokens=16))

    inline = fresh()
    pending = deque(specs)
    while True:
        while pending and pending[0].arrival_tick <= inline.tick:
            submit_spec(inline, pending.popleft())
        if inline.has_work and inline.step():
            continue
        if not pending:
            break
        submit_spec(inline, pending.popleft())
    driven = fresh()
    arrivals = TickArrivals(specs, lambda s: s.arrival_tick)
    run_arrivals(TickDriver(driven, [arrivals]), arrivals)
    assert driven.tick == inline.tick > 0
    outputs = {r.request_id: (r.status, r.output_tokens) for r in inline.done}
    assert {r.request_id: (r.status, r.output_tokens) for r in driven.done} == outputs
    assert len(outputs) == len(specs)
