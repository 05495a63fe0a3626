"""Which GEMM serves decode-sized inputs fastest, and what the native decode kernels buy in the whole step?

    python bench/decode_gemm.py [--batches 1,8,32] [--rounds 3] [--step]

Part 1 multiplies [B, 576] inputs by 30 distinct 3072x576 fp32 weights (212 MB together, more
than the caches hold, so each is streamed from memory as in a SmolLM-size decode step) through
each kind: MKL sgemm, MKL packed sgemm, oneDNN's prepacked copy and the native skinny GEMM
(engine/kernels/skinny_gemm.cpp, on its own packed copy), interleaved round by round, and
prints GB/s of weight streamed (best of rounds, thread CPU time). The weights are SmolLM's fused
gate/up shape, so two more kinds time the MLP's first half as the engine ran it before and runs
it now: the skinny GEMM then split + SiLU * up in torch, and the fused SwiGLU kernel
(engine/kernels/swiglu_gemm.py: SiLU and the product on the accumulators, one call). Part 2 (``--step``) times the
whole SmolLM-size decode step, interleaved step by step, four ways: MKL sgemm only (no decode
prepacking, no native kernels), oneDNN decode prepacking, + the fused native GDN step and RMSNorm,
+ the native skinny GEMM (the engine's default where the kernels build).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.kernels import native, skinny_gemm, swiglu_gemm
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
    has_skinny = skinny_gemm.available()
    skinny = [skinny_gemm.pack(w) for w in weights] if has_skinny else []
    swiglu = [swiglu_gemm.pack(w, OUT // 2) for w in weights] if has_skinny else []
    if not has_skinny:
        print("native skinny GEMM unavailable here (see the log line): its columns are left out")

    def split_silu_mul(y: torch.Tensor) -> torch.Tensor:
        gate, up = y.split(OUT // 2, dim=-1)
        return F.silu(gate) * up

    for batch in batches:
        x = torch.randn(batch, IN)
        kinds = {
            "sgemm": lambda: [F.linear(x, w) for w in weights],
            "mkl packed": lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, batch) for p, w in zip(mkl, weights)],
            "onednn packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn],
        }
        if has_skinny and batch <= skinny_gemm.MAX_ROWS:
            kinds["native skinny"] = lambda: [skinny_gemm.linear(x, p, OUT) for p in skinny]
            kinds["skinny+silu*up"] = lambda: [split_silu_mul(skinny_gemm.linear(x, p, OUT)) for p in skinny]
            kinds["fused swiglu"] = lambda: [swiglu_gemm.swiglu(x, p, OUT // 2) for p in swiglu]
        best: dict[str, float] = {}
        for _ in range(rounds):
            for kind, fn in kinds.items():
                best[kind] = min(best.get(kind, float("inf")), timed(fn))
        print(f"batch {batch:<2}: " + "  ".join(f"{kind} {total_bytes / s / 1e9:5.1f} GB/s ({s * 1e3:6.1f} ms)"
                                               for kind, s in best.items()))


# (decode prepacking, native GDN step and RMSNorm, native skinny GEMM) per configuration of part 2.
STEP_CONFIGS = {
    "sgemm": (False, False, False),
    "onednn": (True, False, False),
    "+gdn/norm kernels": (True, True, False),
    "+skinny gemm": (True, True, True),
}


def whole_step(batches: list[int], rounds: int) -> None:
    import bench.forward as forward
    from engine.model import layers

    forward.CLOCK = time.thread_time
    ours = forward.Ours(forward.build("smol", torch.float32), len(STEP_CONFIGS) * rounds * len(batches) + 2)
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for batch in batches:
            for name, (prepack, gdn, skinny) in STEP_CONFIGS.items():
                layers.DECODE_PREPACK_ENABLED, native.ENABLED, skinny_gemm.ENABLED = prepack, gdn, skinny
                times.setdefault((batch, name), []).append(ours.decode_step(batch))
    layers.DECODE_PREPACK_ENABLED = native.ENABLED = skinny_gemm.ENABLED = True
    for batch in batches:
        ms = {name: statistics.median(times[(batch, name)]) * 1e3 for name in STEP_CONFIGS}
        base = ms["sgemm"]
        print(f"smol decode b{batch:<2}: " + "  ".join(f"{name} {value:6.1f} ms ({base / value:4.2f}x)"
                                                       for name, value in ms.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step", action="store_true", help="also time the whole smol decode step per configuration")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"cpu={cpu_model()} ({isa_summary(cpu_flags())}) threads=1 torch={torch.__version__}")
    gemm_kinds(batches, args.rounds)
    if args.step:
        whole_step(batches, args.rounds)


if __name__ == "__main__":
    main()
