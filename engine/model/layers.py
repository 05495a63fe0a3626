"""Building blocks shared by the Qwen3.5 layers: norms, SwiGLU MLP, partial rotary embedding, prepacked linears."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


# Rows from which a oneDNN-prepacked weight beats MKL's sgemm (measured on AVX2 CPUs, float32):
# 5-10% faster at prefill sizes (hundreds of rows), 2x slower for a single decode row.
PACKED_MIN_ROWS = 64


# Off unless CHUNKSCOPE_ONEDNN_PREPACK=1: a serving engine sees a new chunk length almost
# every tick, and oneDNN's per-shape primitives and buffers then grow resident memory without
# bound (measured: +470 MB over 6,000 tiny-model ticks, flat without it), which breaks the
# "memory flat once warm" promise for a ~10% prefill gain. Benchmarks of fixed shapes opt in.
PREPACK_ENABLED = os.environ.get("CHUNKSCOPE_ONEDNN_PREPACK") == "1"


def _can_prepack(weight: torch.Tensor) -> bool:
    return (PREPACK_ENABLED and weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class FusedLinear:
    """``y = x @ weight^T + bias`` over a fixed weight, with a oneDNN-prepacked copy for many-row inputs.

    The copy is made once (``weight`` [out, in] float32 on CPU); inputs of at least
    ``PACKED_MIN_ROWS`` rows (prefill chunks) use it, fewer rows (decode) keep MKL's GEMV/GEMM.
    On other devices or dtypes it is a plain ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.packed = None
        if prepack and _can_prepack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 512)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= PACKED_MIN_ROWS and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32 (5 ops on the fp32 hot path, no dtype round trips)."""
    x32 = x if x.dtype == torch.float32 else x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight is an offset from 1: ``x / rms(x) * (1 + weight)``.

    Qwen3.5 stores zeros at init, so a checkpoint's weight must never be used as a plain scale.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.scale: torch.Tensor | None = None  # float32 (1 + weight), set by fuse()

    def fuse(self) -> None:
        """Precompute ``1 + weight`` once (call after loading weights)."""
        self.scale = (1.0 + self.weight.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        out = _rms_normalize(x, self.eps) * scale
        return out if out.dtype == x.dtype else out.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Plain-scale RMSNorm followed by a SiLU gate (the Gated DeltaNet output norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = _rms_normalize(x, self.eps)
        if x.dtype != torch.float32:
            normed = normed.to(x.dtype)  # round where the reference rounds, before the weight
        out = self.weight * normed
        gate32 = gate if gate.dtype == torch.float32 else gate.float()
        out = out * F.silu(gate32)
        return out if out.dtype == x.dtype else out.to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are fused into one GEMM after loading."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused_gate_up: FusedLinear | None = None
        self.fused_down: FusedLinear | None = None

    def fuse(self) -> None:
        """Concatenate gate and up weights so the hot path does one GEMM instead of two."""
        self.fused_gate_up = FusedLinear(torch.cat([self.gate_proj.weight, self.up_proj.weight], dim=0))
        self.fused_down = FusedLinear(self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x).split(self.intermediate_size, dim=-1)
            return self.fused_down(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PartialRotary(nn.Module):
    """Rotary embedding on the first ``rotary_dim`` channels of each head (rotate-half layout).

    Text-only Qwen3.5 uses the same position on all three mRoPE axes, which reduces the
    interleaved mRoPE to this plain rotary embedding.
    """

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim / 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [T, rotary_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos/sin: [T, rotary_dim]."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        rot = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
        return torch.cat([rot, rest], dim=-1)
