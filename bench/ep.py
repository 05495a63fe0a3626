"""Expert parallelism overhead: ``serve --ep 2`` against ``--ep 1`` on tiny-moe, side by side in one run.

Each round serves the same seeded synthetic workload (every request due at once) with ep=1,
ep=2 over all-to-all and ep=2 over all-gather, interleaved so machine noise hits all alike.
Throughput is output tokens per second of engine loop time (first forward start to last
forward end, from the run's own tick rows); the exchange's share is the summed MoE exchange
time over the summed forward time of every rank (``ep_forward`` events), and the broadcast
share rank 0's broadcast over its forward time.

    python bench/ep.py [--requests 24] [--rounds 2] [--seed 3]

On a 2-core machine both ranks share the cores, so no speedup is expected: the ratio is the
cost of the broadcast and the exchange on top of the same arithmetic.
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.model.cpu_features import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (("ep1", ["--ep", "1"]), ("ep2 all_to_all", ["--ep", "2", "--ep-exchange", "all_to_all"]),
           ("ep2 all_gather", ["--ep", "2", "--ep-exchange", "all_gather"]))



def serve(run_dir: Path, args: list[str], requests: int, seed: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "tiny-moe", "--run-dir", str(run_dir),
                           "--requests", str(requests), "--rate", "100000", "--seed", str(seed), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"serve {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    conn = sqlite3.connect(run_dir / "telemetry.db")
    tokens = conn.execute("SELECT count(*) FROM tokens").fetchone()[0]
    first, last = conn.execute("SELECT min(t_ns), max(t_ns + duration_ns) FROM ticks WHERE path != 'idle'").fetchone()
    forward, exchange = conn.execute(
        "SELECT sum(json_extract(detail, '$.forward_ns')), sum(json_extract(detail, '$.exchange_ns')) "
        "FROM events WHERE kind = 'ep_forward'").fetchone()
    rank0 = conn.execute("SELECT sum(json_extract(detail, '$.broadcast_ns')), sum(json_extract(detail, '$.forward_ns'))"
                         " FROM events WHERE kind = 'ep_forward' AND json_extract(detail, '$.rank') = 0").fetchone()
    conn.close()
    return {"tok_s": tokens / ((last - first) / 1e9), "tokens": tokens,
            "exchange_share": (exchange or 0) / forward if forward else 0.0,
            "broadcast_share": (rank0[0] or 0) / rank0[1] if rank0[1] else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); tiny-moe, {args.requests} requests x {args.rounds} rounds")
    results: dict[str, list[dict]] = {name: [] for name, _ in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-ep-") as tmp:
        for round_no in range(args.rounds):
            for name, extra in CONFIGS:
                result = serve(Path(tmp) / f"{name.replace(' ', '-')}-{round_no}", extra, args.requests, args.seed)
                results[name].append(result)
                print(f"  round {round_no + 1} {name:15s} {result['tok_s']:7.1f} tok/s ({result['tokens']} tokens)",
                      flush=True)
    base = statistics.median(r["tok_s"] for r in results["ep1"])
    print(f"\n{'config':15s} {'tok/s':>8s} {'vs ep1':>7s} {'exchange/forward':>17s} {'broadcast/forward':>18s}")
    for name, rows in results.items():
        tok_s = statistics.median(r["tok_s"] for r in rows)
        exchange = statistics.median(r["exchange_share"] for r in rows)
        broadcast = statistics.median(r["broadcast_share"] for r in rows)
        print(f"{name:15s} {tok_s:8.1f} {tok_s / base:6.2f}x {exchange:16.0%} {broadcast:17.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
