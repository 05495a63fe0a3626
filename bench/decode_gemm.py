"""Which GEMM serves decode-sized inputs fastest: MKL sgemm, MKL packed sgemm or oneDNN's prepacked copy?

    python bench/decode_gemm.py [--batches 1,8,32] [--rounds 3] [--step]

Part 1 multiplies [B, 576] inputs by 30 distinct 3072x576 fp32 weights (212 MB together, more
than the caches hold, so each is streamed from memory as in a SmolLM-size decode step) through
each kind, interleaved round by round, and prints GB/s of weight streamed (best of rounds, thread
CPU time). Part 2 (``--step``) times the whole SmolLM-size decode step with the engine's decode
prepacking on and off, interleaved step by step. The engine uses oneDNN's copy (layers.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.model.cpu_features import cpu_flags, cpu_model, isa_summary

NUM_WEIGHTS, OUT, IN = 30, 3072, 576


def timed(fn, repeats: int = 2) -> float:
    fn()
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats


def gemm_kinds(batches: list[int], rounds: int) -> None:
    weights = [torch.randn(OUT, IN) for _ in range(NUM_WEIGHTS)]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, max(batches)) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 512) for w in weights]  # the engine's hint
    total_bytes = NUM_WEIGHTS * OUT * IN * 4
    for batch in batches:
        x = torch.randn(batch, IN)
        kinds = {
            "sgemm": lambda: [F.linear(x, w) for w in weights],
            "mkl packed": lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, batch) for p, w in zip(mkl, weights)],
            "onednn packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn],
        }
        best: dict[str, float] = {}
        for _ in range(rounds):
            for kind, fn in kinds.items():
                best[kind] = min(best.get(kind, float("inf")), timed(fn))
        print(f"batch {batch:<2}: " + "  ".join(f"{kind} {total_bytes / s / 1e9:5.1f} GB/s ({s * 1e3:6.1f} ms)"
                                               for kind, s in best.items()))


def whole_step(batches: list[int], rounds: int) -> None:
    import bench.forward as forward
    from engine.model import layers

    forward.CLOCK = time.thread_time
    ours = forward.Ours(forward.build("smol", torch.float32), 2 * rounds * len(batches) + 2)
    times: dict[tuple[int, bool], list[float]] = {}
    for _ in range(rounds):
        for batch in batches:
            for on in (True, False):
                layers.DECODE_PREPACK_ENABLED = on
                times.setdefault((batch, on), []).append(ours.decode_step(batch))
    layers.DECODE_PREPACK_ENABLED = True
    for batch in batches:
        on, off = (statistics.median(times[(batch, flag)]) * 1e3 for flag in (True, False))
        print(f"smol decode b{batch:<2}: prepacked {on:7.1f} ms  sgemm {off:7.1f} ms  speed-up {off / on:4.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step", action="store_true", help="also time the whole smol decode step on / off")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"cpu={cpu_model()} ({isa_summary(cpu_flags())}) threads=1 torch={torch.__version__}")
    gemm_kinds(batches, args.rounds)
    if args.step:
        whole_step(batches, args.rounds)


if __name__ == "__main__":
    main()
