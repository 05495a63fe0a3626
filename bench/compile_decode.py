"""The engine's compiled decode step (``engine/model/compiled_decode.py``) against eager, on the tiny model.

    python bench/compile_decode.py [--batches 32,8,5] [--steps 5] [--backend inductor] [--cache-dir DIR]

Compiles the decode step the way ``serve --compile on`` does (batch padded to its bucket, the
block-table width dynamic, inductor's cache under the chunkscope cache dir unless --cache-dir
says otherwise) and prints, per batch size, the first call's wall time (the compile, or a
load from the cache on a second start), then the median CPU time of a compiled step beside an
eager one, interleaved step by step, and the recompiles the run caused. Run it twice: the
second start shows what the persistent cache saves.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.model.compiled_decode import BACKENDS, CompileSettings, use_persistent_cache
from engine.model.cpu_features import cpu_model
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.model.tiny import cache_root
from engine.cache.sequence import SequenceState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,8,5")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor", choices=BACKENDS)
    parser.add_argument("--cache-dir", default=None, help="inductor's cache (default: <chunkscope cache>/inductor)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.steps < 1 or any(b < 1 or b > 64 for b in batches):
        parser.error("--steps must be >= 1 and every batch 1..64")
    use_persistent_cache(args.cache_dir or cache_root() / "inductor")
    torch.set_num_threads(1)
    model = load_model("tiny")[0]
    runners = {kind: ModelRunner.build(model, num_kv_blocks=8 * max(batches) + 8, num_ssm_slots=max(batches),
                                       compile=CompileSettings(args.backend) if kind == "compiled" else None)
               for kind in ("compiled", "eager")}
    seqs = {kind: [] for kind in runners}
    for kind, runner in runners.items():
        for i in range(max(batches)):
            seq = SequenceState(i)
            runner.pools.admit(seq)
            runner.prefill_chunk(seq, list(range(1, 33 + i)), 0, 32 + i, True)
            seqs[kind].append(seq)

    def step(kind: str, size: int) -> float:
        start = time.thread_time()
        runners[kind].decode(seqs[kind][:size], [1] * size)
        return time.thread_time() - start

    print(f"cpu={cpu_model()} torch={torch.__version__} threads=1 backend={args.backend}")
    times: dict[str, list[float]] = {}
    compiled = runners["compiled"].compiled_decode
    for size in batches:
        start = time.perf_counter()
        step("compiled", size)  # compiles its bucket (or loads it from the cache), unless an earlier size did
        print(f"first compiled call at batch {size}: {time.perf_counter() - start:.1f} s wall")
        for _ in range(args.steps):
            for kind in ("compiled", "eager"):
                times.setdefault(f"{kind} b{size}", []).append(step(kind, size))
    for size in batches:
        compiled_ms = statistics.median(times[f"compiled b{size}"]) * 1e3
        eager_ms = statistics.median(times[f"eager b{size}"]) * 1e3
        print(f"decode b{size:<2}: compiled {compiled_ms:6.2f} ms  eager {eager_ms:6.2f} ms  "
              f"speed-up {eager_ms / compiled_ms:4.2f}x (CPU time, medians of {args.steps})")
    print(f"graphs compiled {compiled.num_graphs}, recompiles {compiled.num_recompiles}, "
          f"compile time {compiled.compile_seconds:.1f} s, buckets {sorted(compiled.buckets_run)}")


if __name__ == "__main__":
    main()
