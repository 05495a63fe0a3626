"""Serving with InnerQ vs full precision on the same arrivals and the same small KV byte budget.

Both runs serve one synthetic workload through the real scheduler (``build_engine``, the
prefix cache on, default levers) with ``--kv-cache-mb`` the same for both; arrivals are
pinned to ticks (``arrival_s * ticks_per_s``) so both engines see the same requests at
the same points of their own progress. A request preempted on KV exhaustion ends as
``preempted`` here, so fewer preemptions means more requests served. Printed side by side
(or ``--json``): preemptions, end states, ticks, tokens generated, most KV tokens held at
once, and the calibration state changes of the quantized run.

    python bench/kv_quant_serving.py [--dtype innerq4] [--kv-cache-mb 0.5] [--requests 24]
                                     [--rate 4] [--prompt-len 320] [--output-len 64] [--json]
"""
from __future__ import annotations

import argparse
import os
import sys
import json
import time
from collections import Counter

# The repository root first: bench/telemetry.py must not shadow the telemetry package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.kv_quant import cpu_model  # noqa: E402
from engine.serve.driver import TickArrivals, TickDriver, run_arrivals  # noqa: E402
from engine.serve.engine_setup import build_engine  # noqa: E402
from engine.workload.synthetic import SyntheticWorkload  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

TICKS_PER_S = 20


def serve(specs, kv_cache: dict, ssm_slots: int, seed: int) -> dict:
    ticks: list[ev.Tick] = []
    changes: list[ev.GenericEvent] = []

    def collect(event) -> None:
        if isinstance(event, ev.Tick):
            ticks.append(event)
        elif isinstance(event, ev.GenericEvent) and event.kind == ev.EVENT_KV_QUANT_STATE:
            changes.append(event)

    setup = build_engine("tiny", kv_blocks=1, ssm_slots=ssm_slots, levers=defaults(), seed=seed, emit=collect,
                         kv_cache=kv_cache)
    sched = setup.scheduler
    arrivals = TickArrivals(sorted(specs, key=lambda s: s.arrival_s), lambda s: int(s.arrival_s * TICKS_PER_S))
    start = time.perf_counter()
    run_arrivals(TickDriver(sched, [arrivals]), arrivals)   # idle: the next arrival comes now (no tick)
    wall_s = time.perf_counter() - start
    statuses = Counter(r.status for r in sched.done)
    return {
        "kv_cache_dtype": kv_cache["kv_cache_dtype"], "kv_cache_mb": kv_cache["kv_cache_mb"],
        "kv_blocks": sched.pools.blocks.num_blocks, "preemptions": sched.num_preemptions,
        "finished": statuses.get(ev.REQ_FINISHED, 0), "preempted": statuses.get(ev.REQ_PREEMPTED, 0),
        "other_end_states": {k: v for k, v in statuses.items() if k not in (ev.REQ_FINISHED, ev.REQ_PREEMPTED)},
        "ticks": sched.tick, "tokens_generated": sum(len(r.output_tokens) for r in sched.done),
        "max_kv_tokens_held": max((t.kv_tokens_used or 0) for t in ticks),
        "state_changes": ", ".join(f"{c.detail['new']}@{c.tick}" for c in changes) or "-",
        "wall_s": round(wall_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="innerq4", choices=["innerq8", "innerq4"])
    parser.add_argument("--kv-cache-mb", type=float, default=0.5)
    parser.add_argument("--kv-calib-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second of the workload")
    parser.add_argument("--prompt-len", type=float, default=320, help="median prompt tokens")
    parser.add_argument("--output-len", type=float, default=64, help="median output tokens")
    parser.add_argument("--ssm-slots", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    specs = SyntheticWorkload(vocab_size=256, num_requests=args.requests, rate=args.rate, seed=args.seed,
                              prompt_len_median=args.prompt_len, output_len_median=args.output_len,
                              prompt_len_max=1024).requests()
    runs = [serve(specs, {"kv_cache_dtype": dtype, "kv_cache_mb": args.kv_cache_mb,
                          "kv_calib_tokens": args.kv_calib_tokens if dtype != "auto" else None},
                  args.ssm_slots, args.seed) for dtype in ("auto", args.dtype)]
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "requests": args.requests, "runs": runs}))
        return
    print(f"cpu: {cpu_model()}; {args.requests} requests (median prompt {args.prompt_len:g}, output "
          f"{args.output_len:g} tokens) at {args.rate:g}/s, the same arrivals; --kv-cache-mb {args.kv_cache_mb:g}")
    keys = ("kv_blocks", "preemptions", "finished", "preempted", "other_end_states", "ticks", "tokens_generated",
            "max_kv_tokens_held", "state_changes", "wall_s")
    print(f"{'':<20}{'auto':>26}{args.dtype:>40}")
    for key in keys:
        print(f"{key:<20}{str(runs[0][key]):>26}{str(runs[1][key]):>40}")


if __name__ == "__main__":
    main()
