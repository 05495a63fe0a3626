"""Does torch.compile (inductor, C++ codegen with gcc on CPU) take the per-op overhead out of tiny decode?

    python bench/compile_decode.py [--batches 32,8,5] [--steps 5]

Compiles the tiny model's decode forward (dynamic batch and context sizes, one graph meant for
every decode tick) and prints the compile time, each recompile it caused, and per batch size
the median CPU time of a compiled step beside an eager one, interleaved step by step. The
engine serves eager: on the 2-core AVX2 EPYC this was measured on, compiling took minutes and
the compiled step was not meaningfully faster (see the README's benchmark table).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.model.batch import DecodeGroup, ForwardBatch, build_batch
from engine.model.cpu_features import cpu_model
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.sequence import SequenceState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,8,5")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)
    model = load_model("tiny")[0]
    runner = ModelRunner(model, num_kv_blocks=64 * max(batches), num_ssm_slots=max(batches) + 1)
    seqs = []
    for i in range(max(batches)):
        seq = SequenceState(i)
        runner.admit(seq)
        runner.prefill_chunk(seq, list(range(1, 33 + i)), 0, 32 + i, True)
        seqs.append(seq)

    def next_batch(size: int) -> ForwardBatch:
        chosen = seqs[:size]
        for seq in chosen:
            runner.block_manager.allocate(seq, 1)
        batch = build_batch(None, [(1, s.num_cached_tokens, s.block_table, s.ssm_slot) for s in chosen], 16)
        batch.decode.slot_range = None  # python ints would specialise the graph: gather / scatter instead
        for seq in chosen:
            seq.num_cached_tokens += 1
        return batch

    def decode(token_ids, positions, kv_slots, ssm_slots, block_tables, context_lens, visible):
        group = DecodeGroup(ssm_slots, block_tables, context_lens, visible, None)
        return model.forward.__wrapped__(model, ForwardBatch(token_ids, positions, kv_slots, None, group),
                                         runner.kv_store, runner.ssm_pool, None)

    compiled = torch.compile(decode, dynamic=True)

    def tensors(batch: ForwardBatch):
        group = batch.decode
        return (batch.token_ids, batch.positions, batch.kv_slots, group.ssm_slots, group.block_tables,
                group.context_lens, group.visible)

    print(f"cpu={cpu_model()} torch={torch.__version__} threads=1")
    times: dict[str, list[float]] = {}
    with torch.no_grad():
        for size in batches:
            start = time.perf_counter()
            compiled(*tensors(next_batch(size)))  # compiles (first size) or may recompile (later sizes)
            print(f"first compiled call at batch {size}: {time.perf_counter() - start:.1f} s wall")
            for _ in range(args.steps):
                for kind, fn in (("compiled", lambda b: compiled(*tensors(b))),
                                 ("eager", lambda b: model(b, runner.kv_store, runner.ssm_pool, None))):
                    batch = next_batch(size)
                    start = time.thread_time()
                    fn(batch)
                    times.setdefault(f"{kind} b{size}", []).append(time.thread_time() - start)
    for size in batches:
        compiled_ms = statistics.median(times[f"compiled b{size}"]) * 1e3
        eager_ms = statistics.median(times[f"eager b{size}"]) * 1e3
        print(f"decode b{size:<2}: compiled {compiled_ms:6.2f} ms  eager {eager_ms:6.2f} ms  "
              f"speed-up {eager_ms / compiled_ms:4.2f}x (CPU time, medians of {args.steps})")


if __name__ == "__main__":
    main()
