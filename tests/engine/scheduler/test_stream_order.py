"""Stream ordering: the SSM work after a chunk is ordered after the chunk's forward.

SSM normalization and the prefix cache's SSM snapshot after a chunk read the state the chunk's
forward wrote on the prefill stream, so they run on the prefill stream too; the forward itself
waits for the default stream (admission's slot zeroing and snapshot restore, the decodes a mixed
forward continues). On CPU the host runs in order, so the CPU test checks the ordering as the
scheduler states it (which stream each piece runs on, which wait precedes each forward). The GPU
test (``--gpu``) makes the race real: it delays every prefill-stream forward with a sleep kernel,
so SSM work that did not wait would read stale state and change tokens.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from engine.scheduler.streams import EVENT_DEFAULT_DONE, STREAM_DEFAULT, STREAM_PREFILL
from telemetry import events as ev
from telemetry.levers import defaults

LEVER_SETS = {
    "mixed, tail cut": dict(ssm_tail_ckpt=True),
    "plain, tail cut": dict(ssm_tail_ckpt=True, bisect_no_mix=True),
    "mixed, mid-chunk capture": dict(ssm_tail_ckpt=True, ssm_tail_midchunk=True),
}


def conversation_requests(num: int = 18, seed: int = 4) -> list[tuple[int, list[int], dict]]:
    """Prompts sharing a few long prefixes (snapshot restores), chunked at 32 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(0, 256) for _ in range(rng.randrange(60, 110))] for _ in range(3)]
    return [(i, prefixes[i % 3] + [rng.randrange(0, 256) for _ in range(rng.randrange(5, 50))],
             {"max_tokens": 10}) for i in range(num)]


def run(model, levers, *, device="cpu", before_forward=None, observe=None):
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=256, num_ssm_slots=6, device=device)
    sched = Scheduler(runner, defaults().replace(max_prefill_tokens=32, **levers), emit=rows.append,
                      prefix_cache=True)
    forward = runner.forward

    def instrumented(batch):
        if batch.prefill is not None and before_forward is not None:
            before_forward(sched)
        if observe is not None:
            observe("forward", sched, rows, prefill=batch.prefill is not None)
        return forward(batch)

    runner.forward = instrumented
    if observe is not None:
        for owner, name in ((sched.pools, "normalize"), (sched.pools.ssm, "snapshot")):
            original = getattr(owner, name)

            def wrapped(*args, _original=original, _name=name, **kwargs):
                observe(_name, sched, rows)
                return _original(*args, **kwargs)
            setattr(owner, name, wrapped)
    pending = conversation_requests()
    while pending or sched.has_work:
        if pending and sched.tick % 3 == 0:
            sched.submit(*pending.pop(0))
        if not sched.step() and pending:
            sched.submit(*pending.pop(0))
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0
    return {r.request_id: r.output_tokens for r in sched.done}, rows


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    return model


@pytest.mark.parametrize("name", list(LEVER_SETS))
def test_ssm_work_after_a_chunk_is_ordered_after_its_forward(tiny, name):
    seen: list[tuple] = []

    def observe(what, sched, rows, prefill=False):
        streams = [r for r in rows if isinstance(r, ev.StreamEvent)]
        seen.append((what, sched.streams.current, prefill, streams[-2:]))

    _, rows = run(tiny, LEVER_SETS[name], observe=observe)
    chunks = [r for r in rows if isinstance(r, ev.ChunkDecision)]
    kinds = {r.kind for r in rows if isinstance(r, ev.GenericEvent)}
    assert {"snapshot_taken", "snapshot_restored"} <= kinds, "the workload must take and restore snapshots"
    wanted_path = ev.PATH_PREFILL if "plain" in name else ev.PATH_MIXED
    assert sum(c.path == wanted_path for c in chunks) > 5
    normalizations = [s for s in seen if s[0] == "normalize"]
    snapshots = [s for s in seen if s[0] == "snapshot"]
    assert len(normalizations) == len(chunks) and snapshots
    # Both read the state the chunk's forward wrote on the prefill stream: they run there.
    assert {s[1] for s in normalizations + snapshots} == {STREAM_PREFILL}
    # Every forward with a prefill chunk runs on the prefill stream right after it waited for the default one.
    for what, current, prefill, last_two in (s for s in seen if s[0] == "forward" and s[2]):
        assert current == STREAM_PREFILL
        record, wait = last_two
        assert (record.kind, record.stream, record.event_name) == ("record", STREAM_DEFAULT, EVENT_DEFAULT_DONE)
        assert (wait.kind, wait.target_stream, wait.seq) == ("wait", STREAM_PREFILL, record.seq)


def test_cpu_tokens_do_not_depend_on_the_instrumentation(tiny):
    plain, _ = run(tiny, LEVER_SETS["mixed, tail cut"])
    observed, _ = run(tiny, LEVER_SETS["mixed, tail cut"], observe=lambda *a, **k: None,
                      before_forward=lambda sched: None)
    assert plain == observed


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LEVER_SETS))
def test_cuda_ordering_holds_when_the_prefill_stream_lags(name, monkeypatch):
    """A sleep kernel before every prefill-stream forward: anything that read the SSM state without
    waiting for that stream would read stale state (a wrong snapshot, a skipped normalization)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # Plain fp32 on both sides: TF32 convolutions would move logits by ~1e-3 (cudnn allows it by default).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model_cpu, _, _ = load_model("tiny")
    model_gpu, _, _ = load_model("tiny", device="cuda")
    levers = LEVER_SETS[name]
    cpu, _ = run(model_cpu, levers)
    on_time, _ = run(model_gpu, levers, device="cuda")

    def lag(sched):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on the current (prefill) stream

    lagging, rows = run(model_gpu, levers, device="cuda", before_forward=lag)
    assert sum(r.kind == "snapshot_restored" for r in rows if isinstance(r, ev.GenericEvent)) > 0
    assert lagging == on_time, "a lagging prefill stream changed tokens: some work did not wait for it"
    # Parity with the CPU run (the same tolerance the CUDA parity tests use: greedy tokens equal).
    assert lagging == cpu
