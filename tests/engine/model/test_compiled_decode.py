"""The compiled decode step through the real engine: greedy tokens equal eager, decode-only ticks
compiled and mixed ones eager, one graph per batch bucket and no recompiles as contexts grow.

The wiring is tested with dynamo's cheap ``eager`` backend (the graph capture, guards and
recompiles are dynamo's, whatever the backend); inductor itself is opt-in (CHUNKSCOPE_TEST_INDUCTOR=1).
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.serve.engine_setup import build_engine
from engine.model import compiled_decode
from engine.model.compiled_decode import BATCH_BUCKETS, CompileSettings, bucket_for, resolve_compile
from engine.model.loader import load_model
from engine.model.forward_batch import ForwardBatch, PrefillChunk
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState
from telemetry import events as ev
from telemetry.levers import defaults

CHEAP = CompileSettings("eager", buckets=(1, 2, 4, 8))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")[0]


def test_batches_pad_to_the_smallest_bucket_and_wider_ones_stay_eager():
    assert [bucket_for(n, BATCH_BUCKETS) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65, BATCH_BUCKETS) is None


def test_auto_compiles_on_a_gpu_only_and_bad_choices_are_named(monkeypatch):
    monkeypatch.delenv(compiled_decode.BACKEND_ENV, raising=False)
    assert resolve_compile("auto", "cpu") is None and resolve_compile("off", "cuda") is None
    assert resolve_compile("on", "cpu") == CompileSettings("inductor")
    assert resolve_compile("auto", "cuda") == CompileSettings("inductor", "reduce-overhead")  # CUDA graphs
    with pytest.raises(ValueError, match="--compile"):
        resolve_compile("sometimes", "cpu")
    monkeypatch.setenv(compiled_decode.BACKEND_ENV, "tvm")
    with pytest.raises(ValueError, match="tvm"):
        resolve_compile("on", "cpu")


def _greedy_decode(model, settings, steps: int = 24):
    """Five sequences with prompts of 9-13 tokens decode greedily in batches of 3, 4 and 5 rows
    (buckets 4 and 8); the contexts cross two block boundaries. Returns (tokens, runner, compiled flags)."""
    runner = ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=8, compile=settings)
    seqs = []
    for i in range(5):
        seq = SequenceState(i)
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, list(range(1, 10 + i)), 0, 9 + i, True)
        seqs.append(seq)
    tokens, last, flags = [], [1] * 5, []
    for step in range(steps):
        batch = seqs[: 3 + step % 3]
        logits = runner.decode(batch, last[:len(batch)])
        flags.append(runner.last_forward_compiled)
        last = [int(t) for t in logits.argmax(-1)] + last[len(batch):]
        tokens.append(list(last))
    return tokens, runner, flags


def test_greedy_tokens_equal_eager_with_one_graph_per_bucket(tiny):
    eager, _, eager_flags = _greedy_decode(tiny, None)
    compiled, runner, flags = _greedy_decode(tiny, CHEAP)
    assert compiled == eager
    assert all(flags) and not any(eager_flags)
    step = runner.compiled_decode
    events = step.take_events()
    # Buckets 4 and 8, one graph each; growing contexts (block tables 2 -> 3 wide) recompiled nothing.
    assert sorted(e["bucket"] for e in events) == [4, 8] and step.num_graphs == 2
    assert step.num_recompiles == 0 and not any(e["recompile"] for e in events)


def test_mixed_forwards_and_wide_batches_stay_eager(tiny):
    runner = ModelRunner.build(tiny, num_kv_blocks=64, num_ssm_slots=16, compile=CompileSettings("eager", buckets=(1,)))
    seqs = []
    for i in range(3):
        seq = SequenceState(i)
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, [5, 6, 7, 8], 0, 4, True)
        assert not runner.last_forward_compiled
        seqs.append(seq)
    runner.decode(seqs[:2], [3, 4])  # 2 rows: wider than the only bucket
    assert not runner.last_forward_compiled
    runner.decode(seqs[:1], [3])
    assert runner.last_forward_compiled
    fresh = SequenceState(9)
    runner.pools.admit(fresh)
    # prefill + decode rows in one forward
    runner.forward(ForwardBatch.mixed(seqs[:1], [4], PrefillChunk(fresh, [1, 2, 3], 0, 3, True)))
    assert not runner.last_forward_compiled


def test_scheduler_compiles_decode_ticks_and_emits_each_compile_once():
    """Through build_engine and the tick loop: same greedy outputs as eager; a decode_compile event
    for each bucket's first use and none per tick; warm-up records its compile on the run row."""
    prompts = [list(b"compile me"), list(b"and me too, please"), list(b"x")]

    def serve(compile_choice: str, warm: bool):
        setup = build_engine("tiny", kv_blocks=64, ssm_slots=4, levers=defaults(), compile=compile_choice,
                             compile_warmup=warm)
        events = []
        setup.scheduler.attach_telemetry(events.append)
        requests = [setup.scheduler.submit(i, p, {"max_tokens": 20 + 3 * i, "temperature": 0.0})
                    for i, p in enumerate(prompts)]
        while setup.scheduler.has_work:
            setup.scheduler.step()
        return setup, [r.output_tokens for r in requests], events

    _, eager_tokens, _ = serve("off", False)
    setup, tokens, events = serve("on", False)
    assert tokens == eager_tokens
    assert setup.engine_config["compile"]["active"] and setup.engine_config["compile"]["backend"] == "eager"
    compiles = [e for e in events if isinstance(e, ev.GenericEvent) and e.kind == ev.EVENT_DECODE_COMPILE]
    decode_ticks = [e for e in events if isinstance(e, ev.Tick) and e.path == ev.PATH_DECODE]
    assert len(decode_ticks) > 20
    buckets = [e.detail["bucket"] for e in compiles]
    assert len(buckets) == len(set(buckets)) and set(buckets) <= {1, 2, 4} and 1 in buckets
    assert not any(e.detail["recompile"] for e in compiles) and compiles[-1].detail["num_recompiles"] == 0
    # Every decode tick ran compiled (no fault hook, no MTP rows, batches of at most 3 rows).
    assert setup.runner.compiled_decode.num_calls == len(decode_ticks)
    warmed, _, _ = serve("on", True)
    record = warmed.engine_config["compile"]
    assert record["warmed_buckets"] == [1, 2, 4] and record["compile_s"] > 0


@pytest.fixture(autouse=True)
def cheap_backend(monkeypatch):
    monkeypatch.setenv(compiled_decode.BACKEND_ENV, "eager")
    torch._dynamo.reset()  # graphs from an earlier test would be reused, and no compile counted


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CHUNKSCOPE_TEST_INDUCTOR") != "1",
                    reason="inductor compiles for minutes on a small CPU: opt in with CHUNKSCOPE_TEST_INDUCTOR=1")
def test_inductor_step_matches_eager_greedy(tiny):
    """Opt-in (minutes on a small CPU): inductor's fused kernels give the same greedy tokens."""
    eager, _, _ = _greedy_decode(tiny, None, steps=6)
    compiled, runner, flags = _greedy_decode(tiny, CompileSettings("inductor", buckets=(4, 8)), steps=6)
    assert compiled == eager and all(flags) and runner.compiled_decode.num_recompiles == 0


def test_generate_with_compile_equals_eager_and_reports_the_compile(tiny):
    from engine.cli.generate import generate
    from engine.scheduler.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12)
    eager = generate(tiny, None, [5, 6, 7], params, stop_at_eos=False)
    compiled = generate(tiny, None, [5, 6, 7], params, stop_at_eos=False, compile=CHEAP)
    assert compiled["tokens"] == eager["tokens"] and "compile" not in eager
    assert compiled["compile"]["num_graphs"] == 1 and compiled["compile"]["num_recompiles"] == 0


def test_a_recompile_is_counted_and_flagged(tiny):
    """The counter is live: a guard that fails for a bucket already run (here the token ids' dtype)
    compiles again, and that compile is flagged as a recompile."""
    runner = ModelRunner.build(tiny, num_kv_blocks=8, num_ssm_slots=2, compile=CompileSettings("eager", buckets=(1,)))
    step = runner.compiled_decode
    step([], bucket=1)
    step([], bucket=1)  # same shapes and guards: nothing compiles
    assert [e["recompile"] for e in step.take_events()] == [False] and step.num_recompiles == 0
    padded = step._padded_inputs
    step._padded_inputs = lambda decodes, bucket: (padded(decodes, bucket)[0].int(), *padded(decodes, bucket)[1:])
    step([], bucket=1)
    events = step.take_events()
    assert [e["recompile"] for e in events] == [True] and events[0]["num_recompiles"] == step.num_recompiles == 1


def test_each_step_has_its_own_graphs_despite_tensor_only_guards(tiny):
    """Guards keep tensor metadata only, so two runners over same-shaped tensors would reuse one graph
    (with the first one's Python constants baked in) if they shared a cache: each compiles its own."""
    first = ModelRunner.build(tiny, num_kv_blocks=16, num_ssm_slots=2, compile=CompileSettings("eager", buckets=(1,)))
    first.compiled_decode([], bucket=1)
    second = ModelRunner.build(tiny, num_kv_blocks=16, num_ssm_slots=2, compile=CompileSettings("eager", buckets=(1,)))
    second.compiled_decode([], bucket=1)
    assert first.compiled_decode.num_graphs == second.compiled_decode.num_graphs == 1


def test_without_native_kernels_the_graph_traces_the_torch_paths(tiny, monkeypatch):
    """No native kernels (no compiler, CHUNKSCOPE_NATIVE_KERNELS=0): the custom ops are not used, the
    graph traces the gather + SDPA and tensor GDN paths, and greedy tokens still equal eager."""
    from engine.kernels import native
    monkeypatch.setattr(native, "ENABLED", False)
    eager, _, _ = _greedy_decode(tiny, None, steps=8)
    compiled, runner, flags = _greedy_decode(tiny, CHEAP, steps=8)
    assert compiled == eager and all(flags) and runner.compiled_decode.num_recompiles == 0


def test_padded_rows_pad_into_the_scratch_block_and_keep_only_the_blocks_each_context_reaches():
    decodes = [(7, 17, [3, 5, 9], 2), (8, 4, [6], 0)]  # row 0 writes position 17: block 5, offset 1
    columns, tables = compiled_decode.padded_rows(decodes, bucket=4, block_size=16, scratch_block=11, scratch_slot=4)
    assert columns == [[7, 8, 0, 0], [17, 4, 0, 0], [5 * 16 + 1, 6 * 16 + 4, 11 * 16, 11 * 16], [2, 0, 4, 4]]
    assert tables == [[3, 5], [6, 11], [11, 11], [11, 11]]  # never narrower than MIN_BLOCK_COLUMNS
