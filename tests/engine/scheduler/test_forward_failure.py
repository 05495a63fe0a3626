"""A failing forward ends only its own requests, through the real engine and its telemetry store.

The test fault hook (``engine/model/fault.py``) raises inside the forward, after every layer but
the last wrote its K/V and SSM state, for a chosen request: in a plain prefill chunk, in a mixed
chunk and in a decode tick. Every other request must end exactly as in the same run without the
fault (batching changes no token, so a bystander's tokens may not move either), the engine then
serves 50 more requests normally, the pools are empty, and the SQLite store is intact.
"""
from __future__ import annotations

import json
import random
import sqlite3
from collections import Counter

import pytest

from engine.model.fault import ForwardFault, InjectedFault
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.replay.rerun import load_input, replay_run
from engine.replay.compare import compare
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults
from telemetry.writer import TelemetryWriter

from serve_process import kill_quietly, query, start_serve, stop, wait_for

NUM_MORE = 50


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    return model


def first_wave(seed: int = 11) -> list[tuple[int, list[int], dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(8):
        sampling = {"max_tokens": 12}
        if i % 2:
            sampling.update(temperature=0.8, top_k=20, seed=500 + i)
        out.append((i, [rng.randrange(0, 256) for _ in range(rng.randrange(20, 70))], sampling))
    return out


def second_wave() -> list[tuple[int, list[int], dict]]:
    rng = random.Random(99)
    return [(100 + i, [rng.randrange(0, 256) for _ in range(rng.randrange(3, 40))], {"max_tokens": 6})
            for i in range(NUM_MORE)]


def drive(sched: Scheduler, requests, stagger: int) -> None:
    """Submit one request every ``stagger`` ticks, step until all have ended."""
    pending = list(requests)
    while pending or sched.has_work:
        if pending and sched.tick % stagger == 0:
            sched.submit(*pending.pop(0))
        if not sched.step() and pending:
            sched.submit(*pending.pop(0))


def serve(model, levers, fault: ForwardFault | None, db_path=None):
    """The first wave (staggered so chunks mix with decodes), then 50 more requests."""
    rows: list = []
    writer = None
    runner = ModelRunner.build(model, num_kv_blocks=256, num_ssm_slots=8, fault=fault)
    sched = Scheduler(runner, levers.replace(max_prefill_tokens=32), emit=rows.append)
    if db_path is not None:
        writer = TelemetryWriter(db_path)
        writer.start_run(ev.RunStarted(started_at=0.0, model="tiny", device="cpu", config={}, model_config={},
                                       versions={}, workload={}, levers=levers.as_dict()))
        sched.attach_telemetry(lambda e: (rows.append(e), writer.emit(e)))
    drive(sched, first_wave(), stagger=3)
    first = {r.request_id: r for r in sched.done}
    drive(sched, second_wave(), stagger=1)
    if writer is not None:
        writer.close("finished")
    return sched, rows, first


def assert_pools_empty(sched: Scheduler) -> None:
    runner = sched.runner
    runner.pools.blocks.check_invariants()
    runner.pools.ssm.check_invariants()
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0, "leaked blocks or slots"


def failures(rows) -> list[ev.GenericEvent]:
    return [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind == ev.EVENT_FORWARD_FAILED]


@pytest.fixture(scope="module")
def baseline(tiny):
    """Outputs without any fault, per lever set."""
    cache = {}

    def get(levers):
        key = tuple(sorted(levers.as_dict().items()))
        if key not in cache:
            sched, _, first = serve(tiny, levers, None)
            cache[key] = {rid: (r.status, r.output_tokens) for rid, r in first.items()}
        return cache[key]
    return get


def check_case(tiny, baseline, tmp_path, levers, fault_text: str, *, path: str, outcome: str | None):
    fault = ForwardFault.parse(fault_text)
    db_path = tmp_path / "telemetry.db"
    sched, rows, first = serve(tiny, levers, fault, db_path)
    expected = baseline(levers)
    failed = failures(rows)
    assert len(failed) == 1, [f.detail for f in failed]
    detail = failed[0].detail
    assert detail["path"] == path and detail["error_type"] == InjectedFault.__name__
    ended = set(detail["ended_request_ids"])
    culprit = next(iter(fault.targets))
    assert culprit in ended
    for request_id, request in first.items():
        if request_id in ended:
            assert request.status == ev.REQ_ERROR and "InjectedFault" in request.error, request.error
            assert f"request {culprit}" in request.error
        else:  # bystanders end exactly as without the fault
            assert (request.status, request.output_tokens) == expected[request_id], request_id
    chunk_outcomes = Counter(c.outcome for c in rows if isinstance(c, ev.ChunkDecision))
    if outcome is not None:
        failed_chunks = [c for c in rows if isinstance(c, ev.ChunkDecision) and c.outcome == outcome]
        assert [c.request_id for c in failed_chunks] == [culprit] and failed_chunks[0].path == path
    else:
        assert set(chunk_outcomes) == {ev.OUTCOME_OK}
    later = [r for r in sched.done if r.request_id >= 100]
    assert len(later) == NUM_MORE and all(r.status == ev.REQ_FINISHED for r in later)
    assert_pools_empty(sched)
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = dict(conn.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())
        stored_failed = conn.execute("SELECT count(*) FROM events WHERE kind = ?",
                                     [ev.EVENT_FORWARD_FAILED]).fetchone()[0]
    finally:
        conn.close()
    assert statuses == {ev.REQ_FINISHED: len(first) + NUM_MORE - len(ended), ev.REQ_ERROR: len(ended)}
    assert stored_failed == 1
    return ended, detail, rows


def test_a_failing_plain_chunk_ends_only_its_request(tiny, baseline, tmp_path):
    # bisect_no_mix: chunks run plainly while the others decode, so the failure is a plain chunk.
    levers = defaults().replace(bisect_no_mix=True)
    ended, detail, rows = check_case(tiny, baseline, tmp_path, levers, "4:prefill", path=ev.PATH_PREFILL,
                                     outcome=ev.OUTCOME_FAILED_FORWARD)
    assert ended == {4} and detail["restored_request_ids"] == []
    failed_chunk = next(c for c in rows if isinstance(c, ev.ChunkDecision) and c.outcome != ev.OUTCOME_OK)
    assert failed_chunk.decode_width > 0, "others were decoding (and decoded on) when the chunk failed"


def test_a_failing_mixed_chunk_ends_its_request_and_restores_the_decodes(tiny, baseline, tmp_path):
    ended, detail, rows = check_case(tiny, baseline, tmp_path, defaults(), "5:mixed", path=ev.PATH_MIXED,
                                     outcome=ev.OUTCOME_FAILED_FORWARD)
    assert ended == {5}
    # The fused forward carried decode rows whose SSM state the failed forward had advanced in
    # every layer but the last: they were put back, and their tokens above match the clean run.
    assert detail["restored_request_ids"], "the failed mixed forward had no decode rows"
    failed_tick = next(r.tick for r in rows if isinstance(r, ev.ChunkDecision) and r.outcome != ev.OUTCOME_OK)
    tick = next(r for r in rows if isinstance(r, ev.Tick) and r.tick == failed_tick)
    assert tick.path == ev.PATH_MIXED and tick.num_prefill_tokens == 0 and tick.num_decode_tokens == 0


def test_a_failing_decode_tick_ends_that_batch(tiny, baseline, tmp_path):
    ended, detail, _ = check_case(tiny, baseline, tmp_path, defaults(), "3:decode", path=ev.PATH_DECODE,
                                  outcome=None)
    assert 3 in ended and len(ended) > 1 and detail["restored_request_ids"] == []  # the whole batch
    assert detail["stage"] == "decode forward"


def test_a_failing_first_token_sample_ends_only_its_request(tiny, monkeypatch):
    from engine.scheduler import sample

    original = sample.sample_first_token

    def flaky(logits, params, generator, *args, **kwargs):
        if params.max_tokens == 7:
            raise RuntimeError("sampler exploded")
        return original(logits, params, generator, *args, **kwargs)

    monkeypatch.setattr(sample, "sample_first_token", flaky)
    rows: list = []
    runner = ModelRunner.build(tiny, num_kv_blocks=128, num_ssm_slots=4)
    sched = Scheduler(runner, defaults(), emit=rows.append)
    drive(sched, [(0, list(range(1, 30)), {"max_tokens": 5}), (1, list(range(3, 40)), {"max_tokens": 7}),
                  (2, list(range(5, 20)), {"max_tokens": 5})], stagger=2)
    statuses = {r.request_id: r.status for r in sched.done}
    assert statuses == {0: ev.REQ_FINISHED, 1: ev.REQ_ERROR, 2: ev.REQ_FINISHED}
    bad = next(r for r in sched.done if r.request_id == 1)
    assert bad.error == "first-token sampling failed: RuntimeError: sampler exploded"
    chunk = next(c for c in rows if isinstance(c, ev.ChunkDecision) and c.request_id == 1 and c.is_last)
    assert chunk.outcome == ev.OUTCOME_FAILED_FIRST_TOKEN
    assert_pools_empty(sched)


def test_fault_text_is_checked():
    assert ForwardFault.parse("7, 12:decode,15:prefill+mixed").targets == {
        7: frozenset({"prefill", "mixed", "decode"}), 12: frozenset({"decode"}),
        15: frozenset({"prefill", "mixed"})}
    assert ForwardFault.parse("15:mixed+prefill").describe() == "15:prefill+mixed"
    for bad, message in (("x", "does not start with a request id"), ("3:verify", "unknown forward kind"),
                         (" , ", "names no request id")):
        with pytest.raises(ValueError, match=message):
            ForwardFault.parse(bad)
    assert ForwardFault.from_env({}) is None and ForwardFault.from_env({"CHUNKSCOPE_FAULT_FORWARD": " "}) is None


def test_serve_with_the_fault_variable_keeps_serving(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_serve(run_dir, "--workload", "synthetic", "--requests", "12", "--rate", "40",
                       env_extra={"CHUNKSCOPE_FAULT_FORWARD": "2"})
    db = run_dir / "telemetry.db"
    try:
        wait_for(lambda: proc.poll() is not None, "serve to finish its 12 requests", proc=None)
        status, stderr = stop(proc) if proc.poll() is None else (proc.returncode, "")
    finally:
        kill_quietly(proc)
    assert status == 0
    statuses = dict((r["status"], r["n"]) for r in query(db, "SELECT status, count(*) AS n FROM requests "
                                                                "GROUP BY status"))
    assert statuses.get(ev.REQ_ERROR, 0) >= 1 and sum(statuses.values()) == 12
    assert query(db, "SELECT status FROM runs")[0]["status"] == "finished"
    log = (run_dir / "engine.log").read_text()
    assert "test fault hook CHUNKSCOPE_FAULT_FORWARD armed" in log
    failed_lines = [line for line in log.splitlines() if "failed (InjectedFault" in line]
    assert len(failed_lines) == len(query(db, "SELECT id FROM events WHERE kind = 'forward_failed'")) >= 1
    assert "Traceback" not in log and "engine loop failed" not in log
    config = json.loads(query(db, "SELECT config FROM runs")[0]["config"])
    assert config["fault_forward"] == "2:prefill+mixed+decode"
    # The run's config carries the hook, so a replay fails the same forward and matches tick for tick.
    recorded, _ = load_input(str(db))
    report = compare(recorded, replay_run(recorded, model="tiny"))
    assert report["decisions_identical"] and report["tokens_identical"], report["first_divergence"]
    assert {r["status_replayed"] for r in report["requests"] if r["request_id"] == 2} == {ev.REQ_ERROR}
