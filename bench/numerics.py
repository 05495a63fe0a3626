"""What ``--numerics reproducible`` costs: the same forwards in native and reproducible numerics, side by side.

    python bench/numerics.py [--model tiny] [--dtype float32 bfloat16] [--prefill 256] [--decode-rows 8]

Per dtype: a prefill chunk of ``--prefill`` tokens and ``--steps`` decode steps of ``--decode-rows`` rows,
each timed as the median of ``--repeats`` runs, in both modes; the ratio is reproducible / native.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.cache.sequence import SequenceState  # noqa: E402
from engine.model import reproducible  # noqa: E402
from engine.model.cpu_features import cpu_flags, cpu_model, isa_summary  # noqa: E402
from engine.serve.engine_setup import build_engine  # noqa: E402
from telemetry.levers import defaults  # noqa: E402


def time_forwards(model: str, dtype: str, numerics: str, args) -> tuple[float, float]:
    """(prefill ms, decode ms per step), medians over the repeats, on a fresh engine each repeat."""
    prefill, decode = [], []
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.repeats):
        setup = build_engine(model, kv_blocks=256, ssm_slots=args.decode_rows + 1, levers=defaults(), dtype=dtype,
                             numerics=numerics)
        runner = setup.runner
        seqs = [SequenceState(i) for i in range(args.decode_rows + 1)]
        for seq in seqs:
            runner.pools.admit(seq)
        prompt = torch.randint(0, 256, (args.prefill,), generator=generator).tolist()
        with torch.no_grad(), reproducible.entered(numerics):
            started = time.perf_counter()
            runner.prefill_chunk(seqs[0], prompt, 0, len(prompt), True)
            prefill.append((time.perf_counter() - started) * 1e3)
            rows = seqs[1:]
            for seq in rows:
                runner.prefill_chunk(seq, prompt[:16], 0, 16, True)
            started = time.perf_counter()
            for _ in range(args.steps):
                runner.decode(rows, [7] * len(rows))
            decode.append((time.perf_counter() - started) * 1e3 / args.steps)
    return statistics.median(prefill), statistics.median(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode-rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"CPU: {cpu_model()} ({isa_summary(cpu_flags())}), torch {torch.__version__}, "
          f"ATen {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} thread(s), model {args.model}")
    print(f"{'dtype':9} {'forward':22} {'native ms':>10} {'reproducible ms':>16} {'ratio':>7}")
    for dtype in args.dtype:
        native = time_forwards(args.model, dtype, reproducible.NATIVE, args)
        pinned = time_forwards(args.model, dtype, reproducible.REPRODUCIBLE, args)
        labels = (f"prefill {args.prefill} tokens", f"decode b{args.decode_rows} (per step)")
        for label, a, b in zip(labels, native, pinned):
            print(f"{dtype:9} {label:22} {a:10.2f} {b:16.2f} {b / a:6.2f}x")


if __name__ == "__main__":
    main()
