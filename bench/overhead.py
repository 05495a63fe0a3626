"""Telemetry overhead: the same seeded workload through the Scheduler with telemetry on and off.

"Off" runs with ``emit=None`` (no event is even built); "on" hands every event
to a real ``TelemetryWriter`` on a temp SQLite store, exactly as ``serve``
does. Runs are interleaved (off, on, off, on, ...) so machine noise hits both
alike; each round is one fresh engine (empty caches) fed every request at
tick 0 and stepped as fast as it goes. Throughput is generated tokens per
second of engine loop time; the writer's drain at close is reported apart
(it happens off the engine thread while serving).

    python bench/overhead.py [--requests 200] [--rounds 3] [--threads N] [--profile]

Target: on >= 0.97 x off (median of the per-round ratios). On a shared machine wall
time is noisy; the tokens per process CPU-second ratio (engine plus writer thread,
drain included) is printed too, and is what other load leaves alone.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The repo root first: bench/telemetry.py would otherwise shadow the telemetry package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.model.loader import load_model  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from engine.serve.driver import TickDriver, submit_spec  # noqa: E402
from engine.workload.synthetic import SyntheticWorkload  # noqa: E402
from telemetry.events import RunStarted  # noqa: E402
from telemetry.levers import defaults  # noqa: E402
from telemetry.writer import TelemetryWriter  # noqa: E402

TARGET_RATIO = 0.97


def workload(model, num_requests: int, seed: int) -> list:
    special = {i for i in (model.eos_token_id,) if i is not None}
    return SyntheticWorkload(num_requests=num_requests, seed=seed, vocab_size=model.config.vocab_size,
                             excluded_ids=special).requests()


def run_once(model, specs, *, telemetry: bool, kv_blocks: int, ssm_slots: int, work_dir: Path,
             profile: cProfile.Profile | None = None) -> dict:
    """One full run; returns tokens, loop seconds, drain seconds, events written."""
    writer = None
    emit = None
    if telemetry:
        writer = TelemetryWriter(work_dir / f"overhead-{time.monotonic_ns()}.db")
        writer.start_run(RunStarted(started_at=time.time(), model="tiny", device="cpu",
                                    config={"kv_blocks": kv_blocks, "ssm_slots": ssm_slots}, model_config={},
                                    versions={}, workload={"kind": "bench"}, levers=defaults().as_dict()))
        emit = writer.emit
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots)
    sched = Scheduler(runner, defaults(), emit=emit, run_seed=0)
    driver = TickDriver(sched)   # every request is there at tick 0
    for spec in specs:
        submit_spec(sched, spec)
    if profile is not None:
        profile.enable()
    start, cpu_start = time.perf_counter(), time.process_time()
    driver.run()
    loop_s = time.perf_counter() - start
    if profile is not None:
        profile.disable()
    num_tokens = sum(len(r.output_tokens) for r in sched.done)
    drain_s, num_events, wait_ns = 0.0, 0, 0
    if writer is not None:
        t = time.perf_counter()
        writer.close()
        drain_s = time.perf_counter() - t
        num_events, wait_ns = writer.flushed_events, writer.writer_wait_ns
    # Process CPU time (engine + writer thread, drain included): the telemetry's whole
    # cost, and unlike wall time not inflated by other processes on a shared machine.
    cpu_s = time.process_time() - cpu_start
    return {"tokens": num_tokens, "ticks": sched.tick, "loop_s": loop_s, "drain_s": drain_s, "cpu_s": cpu_s,
            "events": num_events, "writer_wait_ms": wait_ns / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (off, on); at least 3 for a ratio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--ssm-slots", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="cProfile one extra telemetry-on run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = load_model("tiny")[0]
    specs = workload(model, args.requests, args.seed)
    print(f"workload: {len(specs)} requests, {sum(s.prompt_len for s in specs)} prompt tokens, "
          f"torch threads {torch.get_num_threads()}")
    ratios, cpu_ratios, results = [], [], {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="chunkscope-overhead-") as tmp:
        work_dir = Path(tmp)
        run_once(model, specs[:8], telemetry=True, kv_blocks=args.kv_blocks, ssm_slots=args.ssm_slots,
                 work_dir=work_dir)  # warm-up: first-call allocations and kernel selection
        for round_no in range(args.rounds):
            pair = {}
            for mode in ("off", "on"):
                r = run_once(model, specs, telemetry=mode == "on", kv_blocks=args.kv_blocks,
                             ssm_slots=args.ssm_slots, work_dir=work_dir)
                r["tok_s"] = r["tokens"] / r["loop_s"]
                results[mode].append(r)
                pair[mode] = r
            ratios.append(pair["on"]["tok_s"] / pair["off"]["tok_s"])
            cpu_ratios.append(pair["off"]["cpu_s"] / pair["on"]["cpu_s"])
            print(f"round {round_no + 1}: off {pair['off']['tok_s']:8.1f} tok/s  on {pair['on']['tok_s']:8.1f} tok/s"
                  f"  ratio {ratios[-1]:.3f}  per CPU-s {cpu_ratios[-1]:.3f}  ({pair['on']['events']} events, drain "
                  f"{pair['on']['drain_s'] * 1e3:.0f} ms, producer waited {pair['on']['writer_wait_ms']:.0f} ms)")
        if args.profile:
            profile = cProfile.Profile()
            run_once(model, specs, telemetry=True, kv_blocks=args.kv_blocks, ssm_slots=args.ssm_slots,
                     work_dir=work_dir, profile=profile)
            stats = pstats.Stats(profile).sort_stats("cumulative")
            print("\nprofile of one telemetry-on run (emit path):")
            stats.print_stats(r"emit|record|events\.py|writer\.py")
    assert len({r["tokens"] for rs in results.values() for r in rs}) == 1, "runs must generate the same tokens"
    median_ratio = statistics.median(ratios)
    total_ratio = (sum(r["tokens"] for r in results["on"]) / sum(r["loop_s"] for r in results["on"])) / \
        (sum(r["tokens"] for r in results["off"]) / sum(r["loop_s"] for r in results["off"]))
    off = statistics.median(r["tok_s"] for r in results["off"])
    on = statistics.median(r["tok_s"] for r in results["on"])
    verdict = "meets" if median_ratio >= TARGET_RATIO else "MISSES"
    print(f"\ntelemetry on/off throughput: median ratio {median_ratio:.3f} (totals {total_ratio:.3f}), "
          f"{verdict} the {TARGET_RATIO} target; off {off:.1f} tok/s, on {on:.1f} tok/s, "
          f"{results['off'][0]['tokens']} tokens in {results['off'][0]['ticks']} ticks per run")
    print(f"tokens per process CPU-second (engine + writer thread) on/off: median ratio "
          f"{statistics.median(cpu_ratios):.3f} (robust to other load on the machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
