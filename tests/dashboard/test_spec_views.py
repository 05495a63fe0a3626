"""The speculation views on a real engine run: acceptance by kind, drafts per tick, dropped drafts.

The run: the tiny model through the scheduler in this process, every event sent both to the
real telemetry writer (the store the dashboard reads) and to a list (the expected numbers,
computed here without the dashboard's SQL). Speculation mtp with overlapping requests (fused
ticks drop pending drafts, a small cache preempts), then self, then ngram on lone requests.
"""
from __future__ import annotations

import collections
import random
import sys
import time
from pathlib import Path

import pytest

from dashboard.queries import spec as queries_spec
from dashboard.figures import spec as spec_charts
from dashboard.paths import DB_NAME
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults
from telemetry.writer import TelemetryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "spec"))
from test_spec_identity import serving_arrivals  # noqa: E402

KINDS = ("mtp", "self", "ngram")


class SpecRun:
    def __init__(self, run_dir: Path, events: list, run_id: int):
        self.run_dir, self.events, self.run_id = run_dir, events, run_id

    @property
    def db(self) -> Path:
        return self.run_dir / DB_NAME

    def generic(self, kind: str) -> list:
        return [e for e in self.events if isinstance(e, ev.GenericEvent) and e.kind == kind]


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory) -> SpecRun:
    model, config, _ = load_model("tiny")
    run_dir = tmp_path_factory.mktemp("spec-run")
    events: list = []
    writer = TelemetryWriter(run_dir / DB_NAME)
    levers = defaults().replace(speculation="mtp", num_speculative_tokens=3, max_prefill_tokens=16)
    run_id = writer.start_run(ev.RunStarted(started_at=time.time(), model="tiny", device="cpu", config={},
                                            model_config={}, versions={}, workload={"kind": "test"},
                                            levers=levers.as_dict()))

    def emit(event):
        events.append(event)
        writer.emit(event)

    sched = Scheduler(ModelRunner.build(model, num_kv_blocks=26, num_ssm_slots=4, block_size=8), levers, emit=emit)
    rng = random.Random(5)
    lone = {"self": [(10, (rng.sample(range(32, 127), 4) * 10)[:36], {"max_tokens": 30})],
            "ngram": [(11, (rng.sample(range(32, 127), 3) * 10)[:30], {"max_tokens": 30})]}
    for kind, arrivals in [("mtp", serving_arrivals()), ("self", {0: lone["self"]}), ("ngram", {0: lone["ngram"]})]:
        sched.apply_levers(sched.levers.replace(speculation=kind), source="file")
        start, pending = sched.tick, dict(arrivals)
        while pending or sched.has_work:
            for request in pending.pop(sched.tick - start, []):
                sched.submit(*request)
            if not sched.step():
                sched.tick += 1
    writer.close("finished")
    return SpecRun(run_dir, events, run_id)


def expected_totals(run: SpecRun) -> dict:
    totals = collections.defaultdict(lambda: [0, 0, 0, 0])
    for e in run.generic("spec_step"):
        d = e.detail
        if d["num_drafted"]:
            row = totals[d["kind"]]
            row[0] += 1
            row[1] += d["num_drafted"]
            row[2] += d["num_accepted"]
            row[3] += d["num_emitted"]
    return totals


def test_the_run_has_every_kind_drops_and_preemptions(spec_run):
    assert set(expected_totals(spec_run)) == set(KINDS)
    assert spec_run.generic("drafts_dropped"), "a fused tick should have dropped pending drafts"
    assert any(isinstance(e, ev.Preemption) for e in spec_run.events)


def test_totals_and_acceptance_by_kind_match_the_events(spec_run):
    expected = expected_totals(spec_run)
    totals = queries_spec.totals_by_kind(spec_run.db, spec_run.run_id).set_index("spec_kind")
    assert set(totals.index) == set(KINDS)
    for kind, (steps, drafted, accepted, emitted) in expected.items():
        row = totals.loc[kind]
        assert (row.num_steps, row.num_drafted, row.num_accepted, row.num_emitted) == (steps, drafted, accepted, emitted)
        assert row.acceptance == pytest.approx(accepted / drafted)
        assert row.tokens_per_step == pytest.approx(emitted / steps)
    buckets = queries_spec.acceptance_over_time(spec_run.db, spec_run.run_id)
    sums = buckets.groupby("spec_kind")[["num_drafted", "num_accepted"]].sum()
    for kind, (_, drafted, accepted, _) in expected.items():
        assert (sums.loc[kind, "num_drafted"], sums.loc[kind, "num_accepted"]) == (drafted, accepted)
    assert buckets["acceptance"].between(0, 1).all()
    # Kinds took turns: mtp's buckets all come before self's, self's before ngram's.
    first = buckets.groupby("spec_kind")["bucket_s"].min()
    assert first["mtp"] < first["self"] < first["ngram"]


def test_steps_and_drops_in_a_window_beside_their_fused_ticks(spec_run):
    steps = queries_spec.steps_since(spec_run.db, spec_run.run_id, 0)
    with_drafts = [e for e in spec_run.generic("spec_step") if e.detail["num_drafted"]]
    assert list(steps["tick"]) == [e.tick for e in with_drafts]
    assert list(steps["num_accepted"]) == [e.detail["num_accepted"] for e in with_drafts]
    drops = queries_spec.drops_since(spec_run.db, spec_run.run_id, 0)
    dropped = spec_run.generic("drafts_dropped")
    assert list(drops["tick"]) == [e.tick for e in dropped]
    assert list(drops["num_dropped"]) == [e.detail["num_dropped"] for e in dropped]
    ticks = {t.tick: t for t in spec_run.events if isinstance(t, ev.Tick)}
    for row in drops.itertuples():
        assert row.path == ev.PATH_MIXED == ticks[row.tick].path  # the fused tick that dropped them
        assert row.num_prefill_tokens == ticks[row.tick].num_prefill_tokens > 0
    later = queries_spec.steps_since(spec_run.db, spec_run.run_id, with_drafts[-1].tick)
    assert len(later) == 1


def test_figures_draw_what_the_queries_found(spec_run):
    buckets = queries_spec.acceptance_over_time(spec_run.db, spec_run.run_id)
    fig = spec_charts.acceptance_figure(buckets)
    assert sorted(t.name for t in fig.data) == sorted(KINDS)
    steps = queries_spec.steps_since(spec_run.db, spec_run.run_id, 0)
    drops = queries_spec.drops_since(spec_run.db, spec_run.run_id, 0)
    fig = spec_charts.drafts_timeline_figure(steps, drops, (0.0, 1e9))
    traces = {t.name: t for t in fig.data}
    assert list(traces["drafted"].y) == list(steps["num_drafted"])
    assert list(traces["accepted"].y) == list(steps["num_accepted"])
    assert list(traces["drafts dropped (fused tick)"].x) == list(drops["t_ms"] / 1e3)   # s, as the Live timeline
    empty = spec_charts.drafts_timeline_figure(steps.iloc[:0], drops.iloc[:0], (0.0, 1.0))
    assert len(empty.data) == 0


def test_live_page_shows_the_speculation_strip(app, spec_run):
    at = app(run_dir=spec_run.run_dir)
    metrics = {m.label: m.value for m in at.metric}
    for kind, (steps, drafted, accepted, emitted) in expected_totals(spec_run).items():
        assert metrics[f"{kind} acceptance"] == f"{accepted / drafted:.0%}"
        assert metrics[f"{kind} tokens / step"] == f"{emitted / steps:.2f}"
    assert any(s.value == "Speculation" for s in at.subheader)


def test_live_page_without_speculation_says_so(app):
    at = app()  # the synthetic run: no speculative step
    assert any("No speculative step in this run" in c.value for c in at.caption)
