"""Resident memory of many varied-shape prefills, with and without oneDNN prepacking.

A server's prefill rows change almost every tick (chunk length + decode rows), and oneDNN
builds a primitive per input shape. Each mode runs in a fresh process: ``--calls`` prefills
of seeded random lengths in [PACKED_MIN_ROWS, 576] (one chunk each, a fresh sequence per
call), printing RSS after a warm-up and at each quarter of the run, and the CPU ms per call.
On the tiny model every weight is prepacked here (PACKED_MIN_WEIGHT = 0; the engine leaves
weights that small on MKL) so the oneDNN shape mechanism is exercised at tiny-model speed.

Modes:  off        CHUNKSCOPE_ONEDNN_PREPACK=0 (MKL sgemm only)
        raw        prepacked, every row count passed to oneDNN as it comes (the old opt-in path)
        capacity   raw, with ONEDNN_PRIMITIVE_CACHE_CAPACITY=16 (oneDNN's primitive cache limit)
        bucketed   prepacked, rows padded up to layers.packed_rows (the default)

    python bench/prepack_memory.py [--calls 3000] [--modes off,raw,capacity,bucketed] [--model tiny|smol]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = {
    "off": {"CHUNKSCOPE_ONEDNN_PREPACK": "0"},
    "raw": {"CHUNKSCOPE_ONEDNN_PREPACK": "1", "PREPACK_UNBUCKETED": "1"},
    "capacity": {"CHUNKSCOPE_ONEDNN_PREPACK": "1", "PREPACK_UNBUCKETED": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"},
    "bucketed": {"CHUNKSCOPE_ONEDNN_PREPACK": "1"},
}
WARMUP_CALLS = 200


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(calls: int, model_name: str) -> dict:
    """Runs in the child process: the env of its mode is already set."""
    import random
    import time

    import torch

    from engine.model import layers
    from engine.model.runner import ModelRunner
    from engine.cache.sequence import SequenceState
    sys.path.insert(0, os.path.dirname(__file__))
    from forward import build

    if os.environ.get("PREPACK_UNBUCKETED") == "1":
        layers.PACKED_STEPS_PER_OCTAVE = 1 << 30  # a step of 1 row: every row count as it comes
    if model_name == "tiny":
        layers.PACKED_MIN_WEIGHT = 0
    torch.set_num_threads(1)
    model = build(model_name, torch.float32)
    max_len = 576
    runner = ModelRunner.build(model, num_kv_blocks=max_len // 16 + 1, num_ssm_slots=1)
    prompt = [(i * 37) % model.config.vocab_size for i in range(max_len)]
    rng = random.Random(0)
    lengths = [rng.randint(layers.PACKED_MIN_ROWS, max_len) for _ in range(calls)]
    samples = {"quarters": []}
    quarter = (calls - WARMUP_CALLS) // 4
    start = time.thread_time()
    for i, length in enumerate(lengths):
        seq = SequenceState(i)
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, prompt[:length], 0, length, True)
        runner.pools.release(seq)
        if i + 1 == WARMUP_CALLS:
            samples["warm"] = rss_mb()
            start = time.thread_time()
        elif i + 1 > WARMUP_CALLS and (i + 1 - WARMUP_CALLS) % quarter == 0 and len(samples["quarters"]) < 3:
            samples["quarters"].append(rss_mb())
    samples["end"] = rss_mb()
    samples["ms_per_call"] = (time.thread_time() - start) * 1e3 / (calls - WARMUP_CALLS)
    samples["distinct_rows"] = len(set(lengths))
    samples["packed"] = any(getattr(m, "packed", None) is not None
                            for layer in model.model.layers for m in vars(layer.mlp).values())
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--model", default="tiny", choices=["tiny", "smol"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls <= WARMUP_CALLS:
        parser.error(f"--calls must exceed the {WARMUP_CALLS} warm-up calls")
    if args.child:
        print(json.dumps(child(args.calls, args.model)))
        return
    print(f"{args.model}: {args.calls} prefills of random length 128..576 rows; RSS after {WARMUP_CALLS} "
          f"warm-up calls, then at each quarter of the rest")
    for mode in args.modes.split(","):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **MODES[mode]}
        for key in ("CHUNKSCOPE_ONEDNN_PREPACK", "PREPACK_UNBUCKETED", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
            if key not in MODES[mode]:
                env.pop(key, None)
        out = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls), "--model", args.model],
                             env=env, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        quarters = " ".join(f"{mb:6.1f}" for mb in [r["warm"], *r["quarters"], r["end"]])
        print(f"{mode:9s} prepacked={str(r['packed']):5s} RSS MB {quarters}  "
              f"growth {r['end'] - r['warm']:+7.1f} MB  {r['ms_per_call']:6.2f} ms/call (CPU)  "
              f"{r['distinct_rows']} distinct row counts")


if __name__ == "__main__":
    main()
