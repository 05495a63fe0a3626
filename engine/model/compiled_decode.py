"""The compiled decode step: decode-only forwards through ``torch.compile``, batch padded to a few sizes.

A tiny model's decode step is a few hundred small ops; eager PyTorch pays a dispatch for each.
A compiled graph (inductor's fused C++ kernels on CPU; CUDA graphs on a GPU) pays once per
step instead. Shapes are what make or break it: a graph is specialised to its batch size, so
the batch is padded up to the next of ``BATCH_BUCKETS`` (one graph per bucket, compiled at
start or on first use) and the block-table width, which grows with the context, is marked
dynamic (one graph serves every context length). Padding rows decode token 0 at position 0
into a scratch SSM slot and a scratch KV block that no sequence owns, so they touch nothing
real; each output row depends on its own row only, so the real rows are unchanged.

The native decode kernels (the GDN step, the paged attention) enter the graph as torch custom
ops (``engine/kernels/custom_ops.py``), so the graph has no break and writes the SSM pool and
the KV store in place; the layers pick the op while dynamo traces.

Every compile is counted (``torch._dynamo`` frame counters around each call) and handed to
the scheduler as an event (``take_events``): a graph compiled for a bucket that already had
one is a recompile, which the shapes above are built never to cause per tick.
"""
from __future__ import annotations

import logging
import os
import time
import types
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels import custom_ops
from engine.model.batch import DecodeGroup, PackedBatch
from engine.model.layers import decode_projections

log = logging.getLogger("chunkscope.compile")

COMPILE_CHOICES = ("auto", "on", "off")
# Padded batch sizes: at most 2x the rows of a batch, and 7 graphs for every width up to 64.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Dynamo specialises a dimension of size 0 or 1, so the block-table width is never below 2:
# otherwise the first block boundary (context 16 -> 17) would compile a second graph.
MIN_BLOCK_COLUMNS = 2
# The backend behind ``--compile on``; tests set a cheap one (eager, aot_eager) to check the wiring.
BACKEND_ENV = "CHUNKSCOPE_COMPILE_BACKEND"
BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class CompileSettings:
    backend: str                       # a torch.compile backend: inductor, aot_eager or eager
    mode: str | None = None            # "reduce-overhead" (CUDA graphs) on a GPU
    buckets: tuple[int, ...] = BATCH_BUCKETS

    def describe(self) -> dict:
        return {"backend": self.backend, "mode": self.mode, "buckets": list(self.buckets)}


def resolve_compile(choice: str, device: torch.device | str) -> CompileSettings | None:
    """``--compile`` auto / on / off -> the settings, or None for eager.

    auto compiles on a GPU only (CUDA graphs take the launch overhead out of every step at
    little compile cost). On CPU it stays eager: inductor compiled the tiny model's decode for
    minutes on the 2-core EPYC this was measured on when cold (bench/compile_decode.py, docs/benchmarks.md;
    20-85 s for three buckets from a warm cache), for a 1.3-1.5x faster tiny step than eager;
    ``--compile on`` opts in where a server runs long enough to pay that.
    """
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"--compile: {choice!r} is not one of {', '.join(COMPILE_CHOICES)}")
    is_cuda = torch.device(device).type == "cuda"
    if choice == "off" or (choice == "auto" and not is_cuda):
        return None
    backend = os.environ.get(BACKEND_ENV, "inductor")
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(BACKENDS)}")
    return CompileSettings(backend, "reduce-overhead" if is_cuda and backend == "inductor" else None)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``rows`` rows, or None when the batch is wider than every bucket."""
    return next((b for b in buckets if b >= rows), None)


def use_persistent_cache(cache_dir: os.PathLike | str) -> None:
    """Inductor's compiled kernels and FX graphs under ``cache_dir``, so a second start loads them."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def _own_code(method):
    """``method`` rebound over a copy of its code object: dynamo keeps graphs and guards per code
    object, so each ``CompiledDecode`` gets a cache of its own instead of sharing its class's."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(copy, method.__self__)


def padded_rows(decodes, bucket: int, block_size: int, scratch_block: int,
                scratch_slot: int) -> tuple[list[list[int]], list[list[int]]]:
    """(token, position, block table, ssm slot) per row -> ([tokens, positions, K/V slots, SSM slots],
    block tables), padded to ``bucket`` rows. A padding row decodes token 0 at position 0 into the
    scratch block and slot; each table keeps the blocks its context reaches, padded with the scratch
    block (masked out by the context length) to the widest, at least MIN_BLOCK_COLUMNS wide."""
    tokens, positions, kv_slots, slots, used = [], [], [], [], []
    for token, position, table, slot in decodes:
        block = position // block_size
        tokens.append(token)
        positions.append(position)
        kv_slots.append(table[block] * block_size + position % block_size)
        slots.append(slot)
        used.append(table[: block + 1])
    padding = bucket - len(decodes)
    tokens += [0] * padding
    positions += [0] * padding
    kv_slots += [scratch_block * block_size] * padding
    slots += [scratch_slot] * padding
    used += [[scratch_block]] * padding
    width = max(MIN_BLOCK_COLUMNS, max(len(u) for u in used))
    return [tokens, positions, kv_slots, slots], [u + [scratch_block] * (width - len(u)) for u in used]


def step_tensor_guards(guard_entries) -> list[bool]:
    """Dynamo's guard filter: keep the tensor guards (TENSOR_MATCH) of everything but parameters."""
    return [entry.guard_type == "TENSOR_MATCH" and not isinstance(entry.value, torch.nn.Parameter)
            for entry in guard_entries]


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["frames"]["ok"])


class CompiledDecode:
    """Decode-only forwards of ``model`` over ``kv_store`` / ``ssm_pool`` through one compiled function.

    The store and the pool must have their scratch block and slot (``scratch_block`` /
    ``scratch_slot`` at construction). ``num_graphs`` counts every graph compiled,
    ``num_recompiles`` those compiled for a bucket that had one already.
    """

    def __init__(self, model, kv_store, ssm_pool, block_size: int, settings: CompileSettings,
                 device: torch.device):
        if kv_store.scratch_block_id is None or ssm_pool.scratch_slot_id is None:
            raise ValueError("the compiled decode step needs a KV store and SSM pool with scratch space")
        self.model, self.kv_store, self.ssm_pool = model, kv_store, ssm_pool
        # The native kernels the graph calls as custom ops, built before any trace.
        custom_ops.load_kernels(cpu_operators=torch.device(device).type == "cpu")
        if custom_ops.native_gemm_ready():  # every decode GEMM through the C++ skinny operator
            for projection in decode_projections(model):
                projection.pack_for_compiled_decode()
        self.block_size, self.settings, self.device = block_size, settings, device
        # One cache entry per bucket on the same function: dynamo's per-function limit (8) would send
        # the widest buckets back to eager without a word, so it is raised to fit them all twice over.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(settings.buckets))
        # Guards on the step's tensors only (shapes, dtypes, strides: the bucket and the width), not on
        # the ~550 others dynamo adds for the Python objects the trace read (modules, flags, dicts):
        # checking those cost ~0.3 ms a step, a tenth of a tiny b32 step. What they guard is fixed
        # once the engine is built (the kernel switches included: flip them before building a step),
        # and each step compiles its own copy of the code, so graphs traced for another model, store
        # or pool are never candidates. A CUDA graph mode keeps dynamo's full set (mode and options
        # exclude each other).
        # Inductor's size / stride asserts on every buffer (~50 a step) are off for the same reason.
        options = None
        if settings.mode is None:
            options = {"guard_filter_fn": step_tensor_guards}
            if settings.backend == "inductor":
                options.update(size_asserts=False, alignment_asserts=False)
        self._compiled = torch.compile(_own_code(self._decode), backend=settings.backend, mode=settings.mode,
                                       options=options, dynamic=False)
        self.buckets_run: set[int] = set()  # buckets this step has run (a compile for one of them is a recompile)
        self.num_graphs = 0
        self.num_recompiles = 0
        self.compile_seconds = 0.0
        self.num_calls = 0  # forwards run compiled
        self._events: list[dict] = []

    def accepts(self, rows: int) -> bool:
        return bucket_for(rows, self.settings.buckets) is not None

    def warm_up(self, max_rows: int) -> float:
        """Compile every bucket a batch of up to ``max_rows`` rows uses (padding rows only); seconds taken."""
        started = time.perf_counter()
        top = bucket_for(max_rows, self.settings.buckets) or self.settings.buckets[-1]
        for bucket in self.settings.buckets:
            if bucket > top:
                break
            self([], bucket=bucket)
        return time.perf_counter() - started

    def take_events(self) -> list[dict]:
        """The compiles since the last call: bucket, seconds, graphs, recompile flag and running totals."""
        events, self._events = self._events, []
        return events

    def __call__(self, decodes: list[tuple[int, int, list[int], int]] | None,
                 bucket: int | None = None) -> torch.Tensor:
        """decodes: (token, position, block table, ssm slot) per row -> logits [B, V].

        ``bucket`` pads to that size instead of the smallest that fits (warm-up with no rows).
        """
        decodes = decodes or []
        bucket = bucket or bucket_for(len(decodes), self.settings.buckets)
        inputs = self._padded_inputs(decodes, bucket)
        before, started = _frames_compiled(), time.perf_counter()
        with torch.inference_mode():
            logits = self._compiled(*inputs)  # [P, V]
        compiled = _frames_compiled() - before
        if compiled:
            self._note_compile(bucket, compiled, time.perf_counter() - started)
        self.buckets_run.add(bucket)
        self.num_calls += 1
        return logits[:len(decodes)]

    # ---- helpers ------------------------------------------------------------------------------
    def _padded_inputs(self, decodes, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows padded to ``bucket`` rows, as the compiled function's two tensors.

        Two tensors, not one per field: each conversion costs microseconds, and the Python around
        a tiny model's step is a good part of it.
        """
        columns, tables = padded_rows(decodes, bucket, self.block_size, self.kv_store.scratch_block_id,
                                      self.ssm_pool.scratch_slot_id)
        # Through numpy: torch.tensor on nested lists takes 4x as long.
        rows = torch.from_numpy(np.array(columns, dtype=np.int64)).to(self.device)  # [4, P]
        block_tables = torch.from_numpy(np.array(tables, dtype=np.int64)).to(self.device)  # [P, width]
        torch._dynamo.maybe_mark_dynamic(block_tables, 1)  # the context grows: one graph for every width
        return rows, block_tables

    def _decode(self, rows, block_tables):
        """The traced step: rows [4, P] (token ids, positions, K/V slots, SSM slots), block tables [P, W]
        -> logits [P, V]."""
        token_ids, positions, kv_slots, ssm_slots = rows.unbind(0)  # [P] each
        context_lens = positions + 1
        columns = torch.arange(block_tables.shape[1] * self.block_size, device=token_ids.device)
        visible = (columns[None, :] < context_lens[:, None])[:, None, None, :]  # [P, 1, 1, W * block]
        group = DecodeGroup(ssm_slots, block_tables, context_lens, visible, slot_range=None)
        batch = PackedBatch(token_ids, positions, kv_slots, None, group)
        # The undecorated forward: inference mode is set around the compiled call, not traced.
        return type(self.model).forward.__wrapped__(self.model, batch, self.kv_store, self.ssm_pool, None)

    def _note_compile(self, bucket: int, graphs: int, seconds: float) -> None:
        recompile = bucket in self.buckets_run
        self.num_graphs += graphs
        self.num_recompiles += int(recompile)
        self.compile_seconds += seconds
        log.info("decode step %s for batch bucket %d: %d graph(s) in %.2f s (%s backend)",
                 "recompiled" if recompile else "compiled", bucket, graphs, seconds, self.settings.backend)
        self._events.append({"bucket": bucket, "seconds": round(seconds, 3), "graphs": graphs,
                             "recompile": recompile, "num_graphs": self.num_graphs,
                             "num_recompiles": self.num_recompiles})
