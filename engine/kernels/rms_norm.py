"""RMSNorm of decode-sized rows in one native call (rms_norm.cpp) where it applies, else None.

For small inputs only (up to MAX_ELEMENTS): there the torch path's ~8 ops cost more in dispatch
than in arithmetic; a prefill chunk's norms stay on torch, whose ops run vectorised at scale.
"""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import native

# Inputs up to this many elements (a 32-row decode batch of hidden 576 is 18,432).
MAX_ELEMENTS = 1 << 16

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_float)


def _kernel():
    return native.bind("rms_norm", "rms_norm_f32", _SIGNATURE)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call; False, logged once, where it cannot)."""
    return _kernel() is not None


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] (2 or 3 dims, unit stride along D) / rms * scale [D] -> a new contiguous tensor; None if not here.

    Float32 CPU only, and never while torch.compile traces (the graph keeps the torch ops).
    """
    if torch.compiler.is_compiling() or not native.enabled():
        return None
    if not (x.dtype == torch.float32 == scale.dtype and x.device.type == "cpu" == scale.device.type
            and x.dim() in (2, 3) and 0 < x.numel() <= MAX_ELEMENTS and x.stride(-1) == 1
            and scale.shape == (x.shape[-1],) and scale.is_contiguous() and available()):
        return None
    # As [outer, inner, D] with strides (ld_outer, ld_inner, 1): a 2-dim x is one outer block.
    outer, ld_outer = (x.shape[0], x.stride(0)) if x.dim() == 3 else (1, 0)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _kernel()(x.data_ptr(), ld_outer, x.stride(-2), scale.data_ptr(), y.data_ptr(), outer, x.shape[-2], x.shape[-1], eps)
    return y
