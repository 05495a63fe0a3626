"""The paged decode attention kernel alone, at smol's decode shapes, with the store cold as in a step.

    python bench/paged_attention.py [--batch 32] [--context 40] [--calls 200] [--dtype float32]

smol has 9 query heads over 3 KV heads of 64; its decode rows sit after ~40 positions in blocks
of 16, scattered over the store. In a real step the other layers' weights (tens of MB) pass
through the caches between two attention calls, so each call here first streams a 64 MB buffer
(not timed) and reads its K/V from memory, as there. Prints the CPU model, the dtype, the kernel
ISA variant and the median and best thread-time of a call; run it in two checkouts side by side
to compare kernel builds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.kernels import native, paged_attention
from engine.model.cpu_features import cpu_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    per_row = -(-args.context // BLOCK)
    num_blocks = 8 * args.batch * per_row  # a store several times what the rows reach, as a pool is
    keys = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    values = torch.randn_like(keys)
    tables = torch.randperm(num_blocks)[: args.batch * per_row].view(args.batch, per_row)  # scattered blocks
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    q = torch.randn(args.batch, HEADS, HEAD_DIM).to(dtype)
    gate = torch.randn_like(q)
    flush = torch.ones(16 << 20)  # 64 MB: the rest of a step's weights between two calls
    times = []
    for _ in range(args.calls):
        flush.sum()  # read, as weights are: no dirty lines to write back during the call
        start = time.thread_time()
        out = paged_attention.decode(q, keys, values, tables, lens, gate)
        times.append(time.thread_time() - start)
    assert out is not None, "the kernel does not apply here"
    print(f"cpu={cpu_model()} dtype={args.dtype} isa={native.variant_in_force()} batch={args.batch} context={args.context} "
          f"calls={args.calls}")
    print(f"paged decode attention: median {statistics.median(times) * 1e6:.1f} us, "
          f"best {min(times) * 1e6:.1f} us a call")


if __name__ == "__main__":
    main()
