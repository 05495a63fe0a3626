"""SwiGLU's gate/up half for decode-sized rows: ``SiLU(x @ G^T) * (x @ U^T)`` in one native call (skinny_gemm.cpp).

The gate and up weights are packed once into shared panels (8 gate columns beside their 8 up
columns, [ceil(I / 8), K, 16] for float32, [ceil(I / 8), ceil(K / 2), 32] for bf16 as
``skinny_gemm.packed_line``); the kernel streams them once per call and applies SiLU and the
product to its accumulators: the torch path's [M, 2I] projection, split, SiLU and product (four
dispatches and two passes over the activations per layer) are gone. Rows and threads as
``skinny_gemm.applies``; None wherever it does not run, and the caller keeps its torch path.
"""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import native, skinny_gemm

PAIR_COLS = skinny_gemm.PANEL_COLS // 2  # gate (and up) columns per panel

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_GEMM_SIGNATURE = (_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64)
_PACK_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR)


def _gemm(dtype: torch.dtype = torch.float32):
    return native.bind("skinny_gemm", f"swiglu_gemm_{skinny_gemm.KINDS[dtype][0]}", _GEMM_SIGNATURE)


def _pack(dtype: torch.dtype = torch.float32):
    return native.bind("skinny_gemm", f"pack_swiglu_weight_{skinny_gemm.KINDS[dtype][0]}", _PACK_SIGNATURE)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call; False, logged once, where it cannot)."""
    return _gemm() is not None and _pack() is not None


def pack(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """gate_up [2I, K] float32 or bf16 CPU (the gate rows, then the up rows) -> packed [ceil(I / 8), ...], or None.

    None too while the skinny GEMM is off (CHUNKSCOPE_SKINNY_GEMM=0, CHUNKSCOPE_NATIVE_KERNELS=0).
    """
    if not (gate_up.dim() == 2 and gate_up.shape[0] == 2 * intermediate and gate_up.dtype in skinny_gemm.KINDS
            and gate_up.device.type == "cpu" and gate_up.stride(1) == 1 and skinny_gemm.ENABLED
            and native.enabled() and available()):
        return None
    inner = gate_up.shape[1]
    packed = gate_up.new_empty(-(-intermediate // PAIR_COLS), *skinny_gemm.packed_line(inner, gate_up.dtype))
    _pack(gate_up.dtype)(gate_up.data_ptr(), gate_up.stride(0), intermediate, inner, packed.data_ptr())
    return packed


def swiglu(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """x [M, K] -> SiLU(gate) * up [M, I] in x's dtype from ``packed = pack(gate_up, I)``; None where the kernel
    does not apply (bf16: SiLU and the product on the float32 sums, rounded once)."""
    if packed.dtype != x.dtype or not skinny_gemm.applies(x):  # once per MLP layer: cheap checks first
        return None
    gemm = _gemm(x.dtype)
    if gemm is None:
        return None
    rows, inner = x.shape
    if (packed.dim() != 3 or packed.shape != (-(-intermediate // PAIR_COLS), *skinny_gemm.packed_line(inner, x.dtype))
            or not packed.is_contiguous()):
        raise ValueError(f"swiglu: x {tuple(x.shape)}, packed {tuple(packed.shape)} for {intermediate} columns do not fit")
    y = x.new_empty(rows, intermediate)  # [M, I]
    gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), y.stride(0), rows, intermediate, inner)
    return y
