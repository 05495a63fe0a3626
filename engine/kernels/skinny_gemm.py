"""Decode-sized ``x @ weight^T``: the native skinny GEMM (skinny_gemm.cpp) where it applies, else None.

It reads the weight in its PyTorch layout, so it needs no packed copy. Single-threaded: with
more torch threads the libraries' GEMMs split the work and the callers keep them.
"""
from __future__ import annotations

import ctypes
import os

import torch

from engine.kernels import native

# Rows up to which it runs (bench/decode_gemm.py, AVX2 EPYC, 1 thread, 30 weights of 3072x576,
# load average 4-5 on the 2 cores, GB/s of weight streamed, oneDNN packed vs skinny: batch 8
# 5.6 vs 6.8, 16 4.6 vs 4.7, 32 2.9 vs 3.2; in the whole smol decode step 1.45x at batch 8).
# Larger batches stay on oneDNN, which tiles its packed copy for them.
MAX_ROWS = 32

# Off on its own (the fused GDN step stays on) with CHUNKSCOPE_SKINNY_GEMM=0; bench/decode_gemm.py flips it.
ENABLED = os.environ.get("CHUNKSCOPE_SKINNY_GEMM", "1") != "0"

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _function():
    lib = native.load("skinny_gemm")
    if lib is None:
        return None
    fn = lib.skinny_gemm_f32
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64]
    fn.restype = None
    return fn


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs natively: float32 CPU, 1..MAX_ROWS rows, unit inner strides, 1 thread."""
    if torch.compiler.is_compiling():  # first: a compiled graph traces the library GEMM, nothing of this
        return False
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 == weight.dtype
            and x.device.type == "cpu" == weight.device.type and x.stride(1) == 1 and weight.stride(1) == 1
            and torch.get_num_threads() == 1 and ENABLED and native.enabled())


_fn = None
_loaded = False


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call; False, logged once, where it cannot)."""
    global _fn, _loaded
    if not _loaded:
        _fn, _loaded = _function(), True
    return _fn is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], or None where the kernel does not apply here."""
    if not (applies(x, weight) and available()):
        return None
    rows, inner = x.shape
    out_cols = weight.shape[0]
    if weight.shape[1] != inner or (bias is not None and bias.shape != (out_cols,)):
        raise ValueError(f"skinny linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    y = x.new_empty(rows, out_cols)  # [M, N]
    _fn(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), rows, out_cols, inner)
    return y
