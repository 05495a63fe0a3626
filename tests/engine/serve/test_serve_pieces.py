"""The serve process's pieces without a process: the workload feed by wall time, the stall watch's
heartbeat fields, and the engine ``build_engine`` wires (collaborators at construction, the run row)."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from engine.serve.engine_setup import build_engine, checkpoint_hash, run_started_row
from engine.serve.stall_watch import StallWatch
from engine.serve.workload_feed import EPOCH_REQUESTS, WorkloadFeed
from engine.workload.request import WorkloadError
from telemetry.levers import defaults


def feed_args(**kw) -> SimpleNamespace:
    base = dict(workload="synthetic", requests=None, rate=50.0, seed=3, grammar_share=0.0, time_scale=1.0,
                length_scale=1.0, start=0, limit=None)
    return SimpleNamespace(**{**base, **kw})


SETUP = SimpleNamespace(config=SimpleNamespace(vocab_size=272), special_ids={256})


def test_a_feed_hands_out_requests_as_their_time_comes():
    feed = WorkloadFeed.from_args(feed_args(requests=5), SETUP)
    first = feed.next_arrival_s()
    assert list(feed.due(first - 1e-9)) == []
    due = list(feed.due(first))
    assert len(due) >= 1 and all(s.arrival_s <= first for s in due)
    rest = list(feed.due(float("inf")))
    assert len(due) + len(rest) == 5 and feed.is_exhausted and feed.next_arrival_s() == float("inf")
    assert feed.describe()["kind"] == "synthetic"


def test_an_endless_feed_draws_epoch_after_epoch_with_fresh_ids():
    feed = WorkloadFeed.from_args(feed_args(), SETUP)
    specs = list(itertools.islice(feed.due(float("inf")), 2 * EPOCH_REQUESTS + 1))
    assert [s.request_id for s in specs] == list(range(2 * EPOCH_REQUESTS + 1))
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and feed.describe()["endless"] is True


def test_the_api_only_workload_and_bad_workloads():
    feed = WorkloadFeed.from_args(feed_args(workload="none"), SETUP)
    assert feed.is_exhausted and feed.describe() == {"kind": "none"}
    feed.describe_api("http://127.0.0.1:1")
    assert feed.describe()["api"] == "http://127.0.0.1:1"
    with pytest.raises(WorkloadError, match="needs a CSV path"):
        WorkloadFeed.from_args(feed_args(workload="trace"), SETUP)
    with pytest.raises(WorkloadError, match="must be synthetic"):
        WorkloadFeed.from_args(feed_args(workload="poisson"), SETUP)


@pytest.fixture(scope="module")
def setup():
    return build_engine("tiny", kv_blocks=8, ssm_slots=2, levers=defaults().replace(max_prefill_tokens=32),
                        device="cpu", seed=4)


def test_build_engine_hands_the_collaborators_to_the_scheduler(setup):
    sched = setup.scheduler
    assert sched.detokenize is not None and sched.grammars is not None   # tiny has a tokenizer
    assert sched.eos_ids == frozenset({setup.model.eos_token_id}) and sched.run_seed == 4
    assert sched.pools.blocks is setup.runner.pools.blocks and sched.prefix is not None
    assert "roofline_rates" not in setup.engine_config
    with pytest.raises(AttributeError):
        sched.grammars = None   # given at construction, never set afterwards


def test_the_run_row_describes_the_engine(setup):
    row = run_started_row(setup, None, {"kind": "test"}, ["python", "-m", "x"])
    assert row.model == "tiny" and row.config["kv_blocks"] == 8 and row.config["prefix_cache"] is True
    assert row.levers["max_prefill_tokens"] == 32 and row.checkpoint_hash == checkpoint_hash(setup.checkpoint_dir)
    assert row.workload == {"kind": "test"} and row.config["kv_cache_blocks"] == 8


def test_the_stall_watch_names_what_the_queue_head_waits_for(setup):
    sched = setup.scheduler
    watch = StallWatch()
    assert watch.head_blocker(sched) is None and watch.after_step(sched, progressed=False) is False
    sched.submit(0, list(range(1, 60)), {"max_tokens": 2})   # its 32-token first chunk needs 2 of the 8 blocks
    sched.apply_levers(sched.levers.replace(kv_blocks_cap=1), source="test")
    assert sched.step() is False
    assert watch.after_step(sched, progressed=False) is True and "cap is 1" in watch.blocker
    fields = watch.status_fields(sched)
    assert fields["is_blocked"] and fields["head_request_id"] == 0 and fields["kv_blocks_cap"] == 1
    sched.apply_levers(sched.levers.replace(kv_blocks_cap=0), source="test")
    assert watch.after_step(sched, progressed=sched.step()) is False and watch.blocker is None
    sched.stop()
