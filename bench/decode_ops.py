"""Where one tiny decode step goes: top-level ATen ops, their count by name, and the step's CPU time.

    python bench/decode_ops.py [--batch 32] [--steps 30] [--top 15]

The tiny model (4 layers, 128 wide) is per-op bound: at batch 32 its GEMMs are a third of the
step, the rest is a few hundred small ops each paying PyTorch's dispatch. This prints the
number of top-level ops one ``ModelRunner.decode`` dispatches (ops called by other ops not
counted), the most frequent ones, and the median CPU time of a step (thread time, so a
loaded machine's descheduling is not counted), so an eager change can be judged by both.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.profiler import profile

from engine.model.cpu_features import cpu_model
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState


def top_level_ops(fn) -> list[str]:
    """Names of the ATen ops ``fn`` dispatches from Python (not those other ops call)."""
    with profile() as prof:
        fn()
    return [e.name for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if not 1 <= args.batch <= 256 or args.steps < 1:
        parser.error("--batch must be 1..256 and --steps >= 1")
    torch.set_num_threads(1)
    model = load_model("tiny")[0]
    runner = ModelRunner.build(model, num_kv_blocks=args.batch * (4 + args.steps // 16), num_ssm_slots=args.batch)
    seqs = []
    for i in range(args.batch):
        seq = SequenceState(i)
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, list(range(1, 33)), 0, 32, True)
        seqs.append(seq)
    step = lambda: runner.decode(seqs, [1] * args.batch)  # noqa: E731
    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    ops = top_level_ops(step)
    print(f"cpu={cpu_model()} torch={torch.__version__} threads=1 tiny decode batch {args.batch}")
    print(f"top-level ATen ops per step: {len(ops)}; CPU time per step: {statistics.median(times) * 1e3:.2f} ms "
          f"(median of {args.steps})")
    print("most frequent: " + ", ".join(f"{name.removeprefix('aten::')} {n}"
                                       for name, n in Counter(ops).most_common(args.top)))


if __name__ == "__main__":
    main()
