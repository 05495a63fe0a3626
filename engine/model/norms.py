"""The RMSNorms of the supported families: zero-centred (Qwen3.5), gated by SiLU (the Gated DeltaNet
output) and plain-scale (Kimi Linear). Each normalizes in float32 and rounds where its reference rounds."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import rms_norm


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
        if self.scale is not None:
            # One native call for decode-sized rows: fp32 as they are; bf16 widened for the float32
            # kernel and rounded back once (3 ops against the torch path's 8, which computes in fp32 too).
            wide = x.float() if x.dtype == torch.bfloat16 and x.numel() <= rms_norm.MAX_ELEMENTS else x
            out = rms_norm.rms_norm(wide, self.scale, self.eps)
            if out is not None:
                return out if out.dtype == x.dtype else out.to(x.dtype)
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


class RMSNorm(nn.Module):
    """Plain-scale RMSNorm, ``weight * (x / rms(x))`` (Kimi Linear's; transformers' LlamaRMSNorm).

    The normalized rows are rounded to the input dtype before the weight, where the reference rounds.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.scale: torch.Tensor | None = None  # float32 weight for the native kernel, set by fuse()

    def fuse(self) -> None:
        self.scale = self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None and x.dtype == torch.float32:
            out = rms_norm.rms_norm(x, self.scale, self.eps)  # one native call for decode-sized fp32 rows
            if out is not None:
                return out
        normed = _rms_normalize(x, self.eps)
        return self.weight * (normed if normed.dtype == x.dtype else normed.to(x.dtype))
