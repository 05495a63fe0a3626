"""The kernel variants against each other: the same packed copy serves every build, and the GEMMs agree bit for bit.

Every variant this machine can run (native.VARIANTS: avx2, avx512 where the CPU has AVX-512F, and
the avx512 source through SIMDe everywhere SIMDe is installed) runs the same inputs. The skinny
GEMM and the fused SwiGLU accumulate each output as one FMA chain over k in the same order in
every width, and the vector exp is lane for lane the same, so their outputs must be equal, not
close: the 16-lane tiles, the odd last panel, the pair split and the column tails of either build
are checked against the 8-lane one. (Each variant is also compared with the torch paths in
test_native_kernels.py, test_swiglu_gemm.py, test_gdn_step_shapes.py and test_paged_attention.py.)
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import native, skinny_gemm, swiglu_gemm
from tests.engine.kernel_marks import needs_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_kernels(skinny_gemm)]

RUNNABLE = [variant for variant in native.VARIANTS
            if native.why_unavailable(native._cpu_flags(), native.compiler(), variant) is None]
needs_two = pytest.mark.skipif(len(RUNNABLE) < 2, reason=f"only {RUNNABLE} can run here: nothing to compare")


def _each_variant(monkeypatch, fn) -> dict[str, torch.Tensor]:
    results = {}
    for variant in RUNNABLE:
        monkeypatch.setattr(native, "ISA", variant)
        results[variant] = fn()
    return results


@needs_two
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 13, 24, 32])
@pytest.mark.parametrize("out_cols, inner", [(3072, 576), (48, 9), (40, 33), (7, 5)])  # 192, 3, 3 and 1 panels
def test_skinny_gemm_is_bit_equal_in_every_variant(rows, out_cols, inner, monkeypatch):
    gen = torch.Generator().manual_seed(rows + out_cols)
    weight, bias = torch.randn(out_cols, inner, generator=gen), torch.randn(out_cols, generator=gen)
    x = torch.randn(rows, inner + 3, generator=gen)[:, :inner]
    packed = skinny_gemm.pack(weight)
    results = _each_variant(monkeypatch, lambda: skinny_gemm.linear(x, packed, out_cols, bias))
    for variant, got in results.items():
        assert torch.equal(got, results["avx2"]), variant


@needs_two
@pytest.mark.parametrize("rows", [1, 7, 8, 12, 32])
@pytest.mark.parametrize("intermediate, inner", [(1536, 576), (24, 16), (20, 3), (5, 8)])  # 192, 3, 3 and 1 panels
def test_swiglu_is_bit_equal_in_every_variant(rows, intermediate, inner, monkeypatch):
    gen = torch.Generator().manual_seed(rows * 7 + intermediate)
    gate_up = torch.randn(2 * intermediate, inner, generator=gen)
    x = torch.randn(rows, inner, generator=gen) * 4  # SiLU over a wide range of the vector exp
    packed = swiglu_gemm.pack(gate_up, intermediate)
    results = _each_variant(monkeypatch, lambda: swiglu_gemm.swiglu(x, packed, intermediate))
    for variant, got in results.items():
        assert torch.equal(got, results["avx2"]), variant


def test_this_machine_runs_the_16_lane_code_in_some_build():
    """The AVX-512 source must run here, natively or through SIMDe: else nothing here tests it."""
    reason = native.why_unavailable(native._cpu_flags(), native.compiler(), "avx512-simde")
    assert {"avx512", "avx512-bf16", "avx512-simde"} & set(RUNNABLE), f"no avx512 build can run ({reason})"
