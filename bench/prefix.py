"""Prefix caching on a hybrid model: what the ``ssm_tail_ckpt`` lever buys on multi-turn chat.

Runs the same seeded multi-turn workload (every turn resends the conversation so far)
through the real scheduler with the prefix cache on, once with ``ssm_tail_ckpt`` off and
once on, interleaved for ``--rounds`` rounds (the order flips every round so drift in the
machine's load hits both alike). Requests arrive on the wall clock at their workload times.

Prints per configuration the prefix-hit token ratio (hit tokens / prompt tokens, all
requests) and the TTFT p50 of later turns (turn >= 2, counting from 1), then the two
targets: hit ratio with the lever on (>= 0.5) and TTFT p50 ratio on/off (<= 0.6).
Without the lever the KV blocks match but no SSM snapshot exists where the match stops,
so the hybrid model cannot reuse them (the request rows say so).

    python bench/prefix.py [--rounds 2] [--conversations 6] [--turns 4] [--user-len 160]
                           [--midchunk] [--model tiny]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script, bench/ comes first on sys.path and bench/telemetry.py would shadow the
# telemetry package; the repo root (or the installed package) is what is meant.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.model.loader import load_model  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from engine.serve.driver import TickDriver, TimedArrivals  # noqa: E402
from engine.serve.workload_feed import WorkloadFeed  # noqa: E402
from engine.workload.multiturn import MultiTurnWorkload  # noqa: E402
from engine.workload.request import RequestSpec  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

CONFIGS = {
    "ckpt_off": {"ssm_tail_ckpt": False},
    "ckpt_on": {"ssm_tail_ckpt": True},
    "midchunk": {"ssm_tail_ckpt": True, "ssm_tail_midchunk": True},
}


@dataclass
class RunResult:
    num_prompt_tokens: int
    num_hit_tokens: int
    later_ttft_s: list[float]  # TTFT of turns >= 2 (1-based)
    num_ssm_cut_misses: int  # requests whose KV matched further than any SSM snapshot
    wall_s: float

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def replay(model, specs: list[RequestSpec], levers: dict, kv_blocks: int, ssm_slots: int) -> RunResult:
    """Submit each request when its arrival time comes due; step the scheduler in between."""
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots)
    sched = Scheduler(runner, defaults().replace(**levers), prefix_cache=True)
    feed = WorkloadFeed(iter(specs), {})
    start_ns = sched.now_ns()
    driver = TickDriver(sched, [TimedArrivals(feed, lambda: (sched.now_ns() - start_ns) / 1e9)])
    wall = time.perf_counter()
    while not feed.is_exhausted or sched.has_work:
        if not driver.tick().ran and not feed.is_exhausted:
            elapsed_s = (sched.now_ns() - start_ns) / 1e9
            time.sleep(max(0.0, min(0.01, feed.next_arrival_s() - elapsed_s)))
    wall_s = time.perf_counter() - wall
    by_id = {r.request_id: r for r in sched.done}
    failed = [r for r in by_id.values() if r.status != ev.REQ_FINISHED]
    if failed:
        raise RuntimeError(f"{len(failed)} requests did not finish, e.g. {failed[0].request_id}: {failed[0].error}")
    later = [s for s in specs if s.turn is not None and s.turn >= 1]
    ttft = [(by_id[s.request_id].first_token_ns - start_ns) / 1e9 - s.arrival_s for s in later]
    return RunResult(
        num_prompt_tokens=sum(r.prompt_len for r in by_id.values()),
        num_hit_tokens=sum(r.prefix_hit_tokens for r in by_id.values()),
        later_ttft_s=ttft,
        num_ssm_cut_misses=sum(1 for r in by_id.values()
                               if r.prefix_miss_reason and r.prefix_miss_reason.startswith("no SSM snapshot")),
        wall_s=wall_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every configuration once")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=float, default=160, help="median new user tokens per turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0, help="conversation starts per second")
    p.add_argument("--think-time", type=float, default=1.0, help="mean seconds between turns")
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--ssm-slots", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--midchunk", action="store_true", help="also run ssm_tail_ckpt + ssm_tail_midchunk")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")

    torch.set_grad_enabled(False)
    model, config, _ = load_model(args.model)
    special = ("eos_token_id", "think_start_id", "think_end_id", "tool_call_start_id", "tool_call_end_id")
    excluded = {getattr(model, n) for n in special if getattr(model, n, None) is not None}
    workload = MultiTurnWorkload(vocab_size=config.vocab_size, excluded_ids=excluded,
                                 num_conversations=args.conversations, num_turns=args.turns,
                                 rate=args.rate, think_time_s=args.think_time, user_len_median=args.user_len,
                                 user_len_max=4 * int(args.user_len), output_len=args.output_len, seed=args.seed)
    specs = workload.requests()
    info = workload.describe()
    print(f"workload: {len(specs)} requests ({args.conversations} conversations x {args.turns} turns), "
          f"mean prompt {info['mean_prompt_len']} tokens, longest {info['longest_prompt_len']}, "
          f"reusable prompt share {info['reusable_prompt_ratio']:.2f}; model {args.model}, "
          f"{torch.get_num_threads()} threads")
    names = ["ckpt_off", "ckpt_on"] + (["midchunk"] if args.midchunk else [])
    replay(model, specs[:2], CONFIGS["ckpt_on"], args.kv_blocks, args.ssm_slots)  # warm-up
    results: dict[str, list[RunResult]] = {n: [] for n in names}
    order = [(r, n) for r in range(args.rounds) for n in (names if r % 2 == 0 else names[::-1])]
    for round_index, name in tqdm(order, desc="runs", unit="run"):
        results[name].append(replay(model, specs, CONFIGS[name], args.kv_blocks, args.ssm_slots))

    print(f"\n{'config':<10} {'hit ratio':>9} {'TTFT p50 turn>=2':>17} {'p90':>8} {'SSM-cut misses':>15} {'wall':>7}")
    summary = {}
    for name in names:
        runs = results[name]
        ttft = [t for run in runs for t in run.later_ttft_s]
        hit = sum(r.num_hit_tokens for r in runs) / sum(r.num_prompt_tokens for r in runs)
        p50 = statistics.median(ttft)
        p90 = statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else p50
        summary[name] = (hit, p50)
        print(f"{name:<10} {hit:>9.3f} {p50 * 1e3:>14.1f} ms {p90 * 1e3:>5.0f} ms "
              f"{sum(r.num_ssm_cut_misses for r in runs) / len(runs):>15.1f} "
              f"{statistics.mean(r.wall_s for r in runs):>6.1f}s")
    hit_on, p50_on = summary["ckpt_on"]
    _, p50_off = summary["ckpt_off"]
    print(f"\nprefix-hit token ratio, ssm_tail_ckpt on: {hit_on:.3f} (target >= 0.5) "
          f"{'OK' if hit_on >= 0.5 else 'MISSED'}")
    print(f"TTFT p50 ratio on/off, turns >= 2: {p50_on / p50_off:.3f} (target <= 0.6) "
          f"{'OK' if p50_on / p50_off <= 0.6 else 'MISSED'}")
    if "midchunk" in summary:
        print(f"TTFT p50 ratio midchunk/off, turns >= 2: {summary['midchunk'][1] / p50_off:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
