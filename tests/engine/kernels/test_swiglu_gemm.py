"""The fused SwiGLU gate/up kernel (swiglu_gemm) against the torch path it replaces, and the MLP that routes to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native, skinny_gemm, swiglu_gemm
from engine.model import layers
from engine.model.gate_up import GateUpSiLU
from tests.engine.kernel_marks import needs_kernels as needs_kernels_of

needs_kernels = needs_kernels_of(swiglu_gemm)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def torch_swiglu(x: torch.Tensor, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).split(intermediate, dim=-1)
    return F.silu(gate) * up


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 13, 32])
@pytest.mark.parametrize("intermediate, inner", [(1536, 576), (13, 7), (8, 40), (100, 1)])
def test_swiglu_kernel_equals_torch_path(rows, intermediate, inner):
    gen = torch.Generator().manual_seed(rows * 100 + intermediate)
    gate_up = torch.randn(2 * intermediate, inner + 3, generator=gen)[:, :inner]  # a wider row stride
    x = torch.randn(rows, inner + 5, generator=gen)[:, 2:2 + inner]
    packed = swiglu_gemm.pack(gate_up, intermediate)
    assert packed.shape == (-(-intermediate // 8), inner, 16)
    got = swiglu_gemm.swiglu(x, packed, intermediate)
    assert got is not None and got.shape == (rows, intermediate)
    # The GEMM's summation order and the vector exp differ from torch's: float32 rounding of a
    # length-K dot product, carried through SiLU (slope <= 1.1) and the product.
    want = torch_swiglu(x, gate_up, intermediate)
    scale = F.linear(x, gate_up).abs().amax()
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-6 * inner ** 0.5 * scale)


@needs_kernels
def test_swiglu_packing_pairs_gate_and_up_columns():
    gate_up = torch.arange(2 * 11 * 3, dtype=torch.float32).reshape(22, 3)  # gate rows 0..10, up rows 11..21
    packed = swiglu_gemm.pack(gate_up, 11)  # [2, 3, 16]
    assert torch.equal(packed[0, :, :8].t(), gate_up[:8]) and torch.equal(packed[0, :, 8:].t(), gate_up[11:19])
    assert torch.equal(packed[1, :, :3].t(), gate_up[8:11]) and torch.equal(packed[1, :, 8:11].t(), gate_up[19:])
    assert not packed[1, :, 3:8].any() and not packed[1, :, 11:].any()


@needs_kernels
def test_swiglu_kernel_declines_what_it_does_not_cover():
    gate_up = torch.randn(32, 16)
    packed = swiglu_gemm.pack(gate_up, 16)
    assert swiglu_gemm.swiglu(torch.randn(skinny_gemm.MAX_ROWS + 1, 16), packed, 16) is None
    assert swiglu_gemm.swiglu(torch.randn(4, 16, dtype=torch.bfloat16), packed, 16) is None
    assert swiglu_gemm.pack(gate_up.double(), 16) is None and swiglu_gemm.pack(gate_up, 15) is None
    torch.set_num_threads(2)
    assert swiglu_gemm.swiglu(torch.randn(4, 16), packed, 16) is None
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="do not fit"):
        swiglu_gemm.swiglu(torch.randn(4, 16), packed, 24)
    with pytest.raises(ValueError, match="do not fit"):
        swiglu_gemm.swiglu(torch.randn(4, 15), packed, 16)


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
def test_mlp_decode_rows_take_the_kernel_and_match_the_unfused_mlp(monkeypatch):
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    torch.manual_seed(0)
    mlp = layers.SwiGLU(40, 24)
    x = torch.randn(8, 40)
    with torch.inference_mode():
        want = mlp(x)  # before fuse(): the three nn.Linear modules
        mlp.fuse()
        assert isinstance(mlp.fused_gate_up, GateUpSiLU) and mlp.fused_gate_up.runs_native(x)
        assert mlp.fused_gate_up.packed.shape == (3, 40, 16)  # the one packed copy of gate and up
        calls = []
        original = swiglu_gemm.swiglu
        monkeypatch.setattr(swiglu_gemm, "swiglu", lambda *a: calls.append(a[0].shape) or original(*a))
        assert torch.allclose(mlp(x), want, rtol=1e-5, atol=1e-5)
        assert calls == [(8, 40)]
        monkeypatch.setattr(native, "ENABLED", False)  # the library paths (oneDNN halves), same weights
        assert not mlp.fused_gate_up.runs_native(x)
        assert torch.allclose(mlp(x), want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(mlp.fused_gate_up(x), torch_swiglu(x, mlp.fused_gate_up.weight, 24))
    assert not GateUpSiLU(torch.randn(48, 40).double(), 24).skinny
