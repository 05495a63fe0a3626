"""Telemetry writer benchmark: sustained events/s and the producer's hand-over time per event.

usage: python bench/telemetry.py [--events 300000] [--db PATH]

Phase 1 (throughput): a realistic per-tick mix (1 tick, 1 chunk decision,
4 stream events, 16 tokens, request updates, rare generic events) is built
in advance, then emitted as fast as possible; events/s = events / (time to
emit everything and close(), i.e. until all of it is committed).
Phase 2 (hand-over): the same mix emitted the way the engine does it, one
tick's burst then a ~1 ms "forward", timing every emit() call; p99 excludes
nothing. Targets: >= 100,000 events/s, p99 <= 20 us.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from telemetry import events as ev  # noqa: E402
from telemetry.writer import TelemetryWriter  # noqa: E402

TARGET_EVENTS_PER_S = 100_000
TARGET_P99_US = 20.0
DECODE_WIDTH = 16


def tick_events(tick: int) -> list:
    """One scheduler tick's worth of events, with values shaped like the engine's."""
    t = tick * 1_000_000
    rows: list = [ev.Tick(tick=tick, t_ns=t, path=ev.PATH_MIXED, duration_ns=950_000, num_prefill_tokens=64,
                          num_decode_tokens=DECODE_WIDTH, num_active=DECODE_WIDTH, num_waiting=3, num_prefilling=1,
                          kv_blocks_used=200 + tick % 50, kv_blocks_total=512, ssm_slots_used=17, ssm_slots_total=32),
                  ev.ChunkDecision(tick=tick, t_ns=t + 1000, request_id=tick // 8, offset=(tick % 8) * 64, length=64,
                                   prompt_len=512, is_last=tick % 8 == 7, cap_rule=ev.CAP_MAX_PREFILL,
                                   max_prefill_tokens=64, path=ev.PATH_MIXED, can_mix=True,
                                   decode_width=DECODE_WIDTH, duration_ns=900_000)]
    for k, kind in enumerate(("record", "wait", "record", "sync")):
        rows.append(ev.StreamEvent(tick=tick, t_ns=t + 2000 + k, kind=kind, stream="prefill" if k < 2 else "default",
                                   event_name=f"ev{k}", seq=tick * 4 + k, target_stream="default" if kind == "wait" else None))
    for r in range(DECODE_WIDTH):
        rows.append(ev.TokenEvent(tick=tick, t_ns=t + 900_000 + r, request_id=r, index=tick, token_id=(tick * 31 + r) % 151_000))
    if tick % 4 == 0:
        rid = tick % DECODE_WIDTH
        rows.append(ev.RequestRecord(tick=tick, t_ns=t, request_id=rid, status=ev.REQ_DECODING, arrival_ns=t - 10**8,
                                     admitted_ns=t - 9 * 10**7, first_token_ns=t - 5 * 10**7, prompt_len=512,
                                     output_len=tick, prefix_hit_tokens=128,
                                     sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.95, "seed": rid}))
        rows.append(ev.RequestEvent(tick=tick, t_ns=t, request_id=rid, kind="first_token"))
    if tick % 100 == 0:
        rows.append(ev.GenericEvent(tick=tick, t_ns=t, kind="drafts_dropped", detail={"num_drafts": 3}))
    return rows


def run_started() -> ev.RunStarted:
    return ev.RunStarted(time.time(), "bench", "cpu", {"num_kv_blocks": 512}, {}, {"python": sys.version.split()[0]},
                         {"kind": "bench"}, {})


def throughput(db_path: str, num_events: int) -> tuple[float, float, float]:
    events: list = []
    tick = 0
    while len(events) < num_events:
        events += tick_events(tick)
        tick += 1
    writer = TelemetryWriter(db_path)
    writer.start_run(run_started())
    start, start_cpu = time.perf_counter(), time.process_time()
    for event in events:
        writer.emit(event)
    writer.close()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    # events per CPU-second: the rate one uncontended core sustains (wall rate drops on a shared box)
    return len(events) / elapsed, len(events) / cpu, writer.writer_wait_ns / 1e9


def hand_over(db_path: str, num_ticks: int) -> list[int]:
    writer = TelemetryWriter(db_path)
    writer.start_run(run_started())
    clock = time.perf_counter_ns
    samples: list[int] = []
    for tick in range(num_ticks):
        burst = tick_events(tick)
        for event in burst:
            before = clock()
            writer.emit(event)
            samples.append(clock() - before)
        deadline = clock() + 1_000_000  # the "forward": ~1 ms of busy work, as the engine's thread would do
        while clock() < deadline:
            pass
    writer.close()
    return sorted(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--ticks", type=int, default=3000, help="ticks in the hand-over phase")
    parser.add_argument("--db", default=None, help="store path (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db_path = args.db or os.path.join(tmp, "bench.db")
        rate, cpu_rate, wait_s = throughput(db_path, args.events)
        samples = hand_over(db_path, args.ticks)
    p50, p99, top = (samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3, samples[-1] / 1e3)
    print(f"writer sustained: {rate:,.0f} events/s over {args.events:,} events "
          f"(target {TARGET_EVENTS_PER_S:,}: ratio {rate / TARGET_EVENTS_PER_S:.2f}; producer waited {wait_s:.2f}s)")
    print(f"writer per CPU-second: {cpu_rate:,.0f} events/s (ratio {cpu_rate / TARGET_EVENTS_PER_S:.2f}; "
          f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"emit() hand-over: p50 {p50:.2f} us, p99 {p99:.2f} us, max {top:.0f} us over {len(samples):,} calls "
          f"(target p99 <= {TARGET_P99_US:.0f} us: ratio {TARGET_P99_US / p99:.2f})")


if __name__ == "__main__":
    main()
