"""Decode-sized ``x @ weight^T`` (skinny_gemm.cpp): ``pack`` a weight once, then ``linear`` per call.

The packed copy is made once per weight and serves every row count from 1 to MAX_ROWS, so memory
does not grow with the shapes a server sees: float32 weights as [ceil(N / 16), K, 16], bf16 ones
as [ceil(N / 16), ceil(K / 2), 32] (a k pair per column per line: AVX512-BF16's dot product, or
widened to float32 FMAs without it), zero-padded. bf16 calls take bf16 x and return bf16 (float32
sums, rounded once, as torch's bf16 GEMMs). Every kernel variant (native.VARIANTS) reads the same
copy. Single-threaded: with more torch threads the libraries split the work and the callers keep them.
"""
from __future__ import annotations

import ctypes
import os

import torch

from engine.kernels import native

PANEL_COLS = 16  # NR in skinny_gemm.cpp

# Rows up to which it runs (bench/decode_gemm.py, AVX2 EPYC, 1 thread, 30 weights of 3072x576, GB/s
# of weight streamed, best of 3, MKL packed / oneDNN packed / this kernel: batch 1 13.7 / 7.3 / 12.7,
# batch 8 3.5 / 4.5 / 11-12.6, batch 32 2.2 / 2.7 / 4.4-5.1, i.e. ~70-80 GFLOP/s at 32 rows, the
# core's square-GEMM rate). Larger batches stay on oneDNN, which tiles its own packed copy for them.
MAX_ROWS = 32

# Off on its own (the fused GDN step stays on) with CHUNKSCOPE_SKINNY_GEMM=0; bench/decode_gemm.py flips it.
ENABLED = os.environ.get("CHUNKSCOPE_SKINNY_GEMM", "1") != "0"

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_GEMM_SIGNATURE = (_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64)
_PACK_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR)
# The dtypes the kernels take: the C functions' suffix and the k values per column per packed line.
KINDS = {torch.float32: ("f32", 1), torch.bfloat16: ("bf16", 2)}


def _gemm(dtype: torch.dtype = torch.float32):
    return native.bind("skinny_gemm", f"packed_gemm_{KINDS[dtype][0]}", _GEMM_SIGNATURE)


def _pack(dtype: torch.dtype = torch.float32):
    return native.bind("skinny_gemm", f"pack_weight_{KINDS[dtype][0]}", _PACK_SIGNATURE)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call; False, logged once, where it cannot)."""
    return _gemm() is not None and _pack() is not None


def packed_line(inner: int, dtype: torch.dtype) -> tuple[int, int]:
    """(lines per panel, elements per line) of the packed copy of a weight with ``inner`` columns."""
    per_col = KINDS[dtype][1]
    return -(-inner // per_col), PANEL_COLS * per_col


def applies(x: torch.Tensor) -> bool:
    """Whether ``x`` runs natively: float32 or bf16 CPU [1..MAX_ROWS, K] with unit inner stride, at 1 torch thread."""
    if torch.compiler.is_compiling():  # first: a compiled graph traces the library GEMM, nothing of this
        return False
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in KINDS and x.is_cpu
            and x.stride(1) == 1 and torch.get_num_threads() == 1 and ENABLED and native.enabled())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] float32 or bf16 CPU (unit inner stride) -> its packed copy, or None here.

    [ceil(N / 16), K, 16] for float32, [ceil(N / 16), ceil(K / 2), 32] for bf16 (``packed_line``).
    None too while the kernel is off (CHUNKSCOPE_SKINNY_GEMM=0, CHUNKSCOPE_NATIVE_KERNELS=0): no copy is made.
    """
    if not (weight.dim() == 2 and weight.dtype in KINDS and weight.device.type == "cpu"
            and weight.stride(1) == 1 and ENABLED and native.enabled() and available()):
        return None
    out_cols, inner = weight.shape
    packed = weight.new_empty(-(-out_cols // PANEL_COLS), *packed_line(inner, weight.dtype))
    _pack(weight.dtype)(weight.data_ptr(), weight.stride(0), out_cols, inner, packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_cols: int,
           bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype from ``packed = pack(W)``; None where the kernel
    does not apply (a packed copy of another dtype than x's too)."""
    # Every decode projection calls this (~120 times a smol step), so the checks are ordered cheap
    # first and the kernel is looked up once (not through available(), which binds both functions).
    if packed.dtype != x.dtype or not applies(x):
        return None
    gemm = _gemm(x.dtype)
    if gemm is None:
        return None
    rows, inner = x.shape
    shape = packed.shape
    if (len(shape) != 3 or shape[1:] != packed_line(inner, x.dtype) or shape[0] != -(-out_cols // PANEL_COLS)
            or not packed.is_contiguous() or (bias is not None and bias.shape != (out_cols,))):
        raise ValueError(f"skinny linear: x {tuple(x.shape)}, packed {tuple(shape)} for {out_cols} columns, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit")
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    y = x.new_empty(rows, out_cols)  # [M, N]
    gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
         y.data_ptr(), y.stride(0), rows, out_cols, inner)
    return y
