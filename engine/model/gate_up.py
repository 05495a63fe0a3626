"""SwiGLU's first half over the fused gate/up weight: ``SiLU(x @ gate^T) * (x @ up^T)``, [T, hidden] -> [T, I]."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import custom_ops, skinny_gemm, swiglu_gemm


class GateUpSiLU:
    """The gate/up projection with SiLU and the product applied: decode rows in one native call.

    ``weight`` [2I, hidden]: the gate rows, then the up rows. Weights of at least ``min_weight``
    elements get the kernel's packed copy (one per weight, whatever the row count, as the skinny
    GEMM's); a compiled step calls the same kernel as a C++ operator (and packs small weights too);
    other inputs and dtypes take the torch path, one GEMM over the fused weight then SiLU(gate) * up.
    """

    def __init__(self, weight: torch.Tensor, intermediate: int, min_weight: int = 0):
        self.weight = weight.detach()  # [2I, hidden]
        self.intermediate = intermediate
        self.packed = (swiglu_gemm.pack(self.weight, intermediate) if self.weight.numel() >= min_weight
                       else None)  # [ceil(I / 8), hidden, 16]
        self.skinny = self.packed is not None

    def pack_for_compiled_decode(self) -> None:
        """The kernel's packed copy whatever the weight's size (one per weight), for a compiled step: the graph
        calls the kernel as a C++ operator (``layers.FusedLinear.pack_for_compiled_decode`` says why)."""
        if self.packed is None:
            self.packed = swiglu_gemm.pack(self.weight, self.intermediate)

    def traced_applies(self, x: torch.Tensor) -> bool:
        """While dynamo traces: whether ``x`` [T, hidden] takes the C++ operator."""
        return (self.packed is not None and custom_ops.native_gemm_ready() and x.dim() == 2
                and 0 < x.shape[0] <= skinny_gemm.MAX_ROWS and x.dtype == self.packed.dtype
                and x.dtype in skinny_gemm.KINDS and x.device.type == "cpu")

    def runs_native(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [T, hidden] would take the native kernel."""
        if torch.compiler.is_compiling():
            return self.traced_applies(x)
        return self.skinny and skinny_gemm.applies(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> SiLU(gate) * up [T, I]."""
        if torch.compiler.is_compiling() and self.traced_applies(x):
            return torch.ops.chunkscope_native.swiglu_linear(x, self.packed, self.intermediate)
        if self.skinny:
            out = swiglu_gemm.swiglu(x, self.packed, self.intermediate)
            if out is not None:
                return out
        gate, up = F.linear(x, self.weight).split(self.intermediate, dim=-1)  # [T, I] each
        return F.silu(gate) * up
