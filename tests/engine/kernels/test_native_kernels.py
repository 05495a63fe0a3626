"""The native decode kernels (engine/kernels) against the torch paths they replace, and their fallback."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import gdn_step, native, rms_norm, skinny_gemm
from engine.model import layers, norms
from engine.model.gdn import GatedDeltaNet
from engine.model.loader import load_model
from engine.model.tiny import TINY_CONFIG
from tests.engine.kernel_marks import needs_kernels as needs_kernels_of
from tests.engine.model.test_decode_fastpaths import _run

needs_kernels = needs_kernels_of(skinny_gemm, gdn_step, rms_norm)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 13, 16, 21, 32])
@pytest.mark.parametrize("out_cols, inner", [(3072, 576), (7, 13), (250, 1536), (33, 1)])
def test_skinny_gemm_equals_library_gemm(rows, out_cols, inner):
    gen = torch.Generator().manual_seed(rows * 1000 + out_cols)
    weight = torch.randn(out_cols, inner + 3, generator=gen)[:, :inner]  # a row stride wider than the rows
    bias = torch.randn(out_cols, generator=gen)
    x = torch.randn(rows, inner + 5, generator=gen)[:, 2:2 + inner]
    packed = skinny_gemm.pack(weight)
    assert packed.shape == (-(-out_cols // 16), inner, 16)
    got = skinny_gemm.linear(x, packed, out_cols, bias)
    assert got is not None and got.shape == (rows, out_cols)
    # Summation order differs from MKL's: equal to float32 rounding of a length-K dot product.
    tolerance = dict(rtol=1e-5, atol=1e-5 * inner ** 0.5)
    assert torch.allclose(got, F.linear(x, weight, bias), **tolerance)
    assert torch.allclose(skinny_gemm.linear(x, packed, out_cols), F.linear(x, weight), **tolerance)


@needs_kernels
def test_skinny_gemm_packing_pads_columns_with_zeros():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    packed = skinny_gemm.pack(weight)  # [2, 3, 16]: column j of panel p is weight row 16 p + j
    assert torch.equal(packed[0].t(), weight[:16])
    assert torch.equal(packed[1, :, :4].t(), weight[16:]) and not packed[1, :, 4:].any()


@needs_kernels
def test_skinny_gemm_declines_what_it_does_not_cover():
    weight = torch.randn(32, 16)
    packed = skinny_gemm.pack(weight)
    assert skinny_gemm.linear(torch.randn(skinny_gemm.MAX_ROWS + 1, 16), packed, 32) is None
    assert skinny_gemm.linear(torch.randn(4, 16, dtype=torch.bfloat16), packed, 32) is None
    assert skinny_gemm.linear(torch.randn(16, 4).t(), packed, 32) is None  # inner stride != 1
    assert skinny_gemm.pack(weight.double()) is None and skinny_gemm.pack(weight.t()) is None
    torch.set_num_threads(2)
    assert skinny_gemm.linear(torch.randn(4, 16), packed, 32) is None  # the libraries split across threads
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm.linear(torch.randn(4, 16), packed, 32, torch.randn(3))
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm.linear(torch.randn(4, 16), packed, 48)  # more columns than the packed copy holds
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm.linear(torch.randn(4, 15), packed, 32)


@needs_kernels
def test_fused_linear_routes_decode_rows_to_the_kernel(monkeypatch):
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    weight = torch.randn(96, 40)
    linear = layers.FusedLinear(weight)
    assert linear.skinny and linear.runs_native(torch.randn(8, 40))
    assert linear.skinny_packed.shape == (6, 40, 16)  # one packed copy, whatever the row counts
    x = torch.randn(8, 40)
    assert torch.allclose(linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert not linear.runs_native(torch.randn(skinny_gemm.MAX_ROWS + 1, 40))
    monkeypatch.setattr(native, "ENABLED", False)
    assert not linear.runs_native(torch.randn(8, 40))
    assert not layers.FusedLinear(torch.randn(96, 40).double()).skinny


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 7), (32, 9, 64), (5, 1, 13)])
def test_rms_norm_kernel_equals_torch_norm(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    scale = torch.randn(shape[-1], generator=gen)
    got = rms_norm.rms_norm(x, scale, 1e-6)
    assert got is not None and got.shape == x.shape and got.is_contiguous()
    assert torch.allclose(got, norms._rms_normalize(x, 1e-6) * scale, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
def test_rms_norm_kernel_reads_strided_heads():
    """q and k arrive as [T, H, D] views into the fused projection's output, rows wider than H * D."""
    projections = torch.randn(6, 3 * 64 + 40)
    heads = projections[:, 8:8 + 3 * 64].view(6, 3, 64)
    scale = torch.randn(64)
    assert torch.allclose(rms_norm.rms_norm(heads, scale, 1e-6), norms._rms_normalize(heads, 1e-6) * scale,
                          rtol=1e-5, atol=1e-6)


def test_rms_norm_kernel_declines_what_it_does_not_cover(monkeypatch):
    scale = torch.ones(16)
    assert rms_norm.rms_norm(torch.randn(4, 16).bfloat16(), scale, 1e-6) is None
    assert rms_norm.rms_norm(torch.randn(16, 4).t(), scale, 1e-6) is None  # last dim strided
    assert rms_norm.rms_norm(torch.randn(4, 8), scale, 1e-6) is None  # scale of another width
    assert rms_norm.rms_norm(torch.randn(rms_norm.MAX_ELEMENTS // 16 + 1, 16), scale, 1e-6) is None  # prefill-sized
    monkeypatch.setattr(native, "ENABLED", False)
    assert rms_norm.rms_norm(torch.randn(4, 16), scale, 1e-6) is None


def _layer_and_pools(num_slots: int, seed: int):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(TINY_CONFIG, 0)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
    conv = torch.randn(num_slots, layer.conv_dim, layer.conv_kernel - 1)
    rec = torch.randn(num_slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim) * 0.3
    return layer, conv, rec


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
@pytest.mark.parametrize("slots, slot_range", [([4, 0, 2], None), ([1, 2, 3, 4], (1, 5)), ([3], (3, 4))])
def test_gdn_kernel_equals_tensor_decode_step(slots, slot_range):
    """Outputs and both states (conv, recurrent) of the touched slots match; the other slots stay bit-equal."""
    layer, conv, rec = _layer_and_pools(6, seed=len(slots))
    batch = len(slots)
    rows = torch.randn(batch, layer.conv_dim + 7)[:, :layer.conv_dim]  # a strided view, as the projection's split
    g, beta = -torch.rand(batch, layer.num_v_heads) * 2, torch.rand(batch, layer.num_v_heads)
    index = torch.tensor(slots)
    weight = layer.conv1d.weight[:, 0, :]
    conv_native, rec_native = conv.clone(), rec.clone()
    out = gdn_step.decode(rows, conv_native, weight, rec_native, index, g, beta, layer.num_k_heads,
                          layer.head_k_dim, layer.head_v_dim)
    expected = layer._decode_rows(rows, g, beta, conv, rec, index, slot_range)
    assert out is not None and out.shape == expected.shape
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(rec_native, rec, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_native, conv)  # the conv state is only shifted: exact
    untouched = [s for s in range(6) if s not in slots]
    assert torch.equal(rec_native[untouched], rec[untouched])


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
@pytest.mark.parametrize("slots, slot_range", [([4, 0, 2], None), ([1, 2, 3, 4], (1, 5))])
def test_gdn_gated_kernel_equals_torch_gates_and_norm(slots, slot_range):
    """The gates (softplus, sigmoid) and the GatedRMSNorm folded into the native step match the torch path."""
    layer, conv, rec = _layer_and_pools(6, seed=10 + len(slots))
    batch, heads = len(slots), layer.num_v_heads
    with torch.no_grad():
        layer.A_log.normal_(0, 1)
        layer.dt_bias.normal_(0, 1)
        layer.norm.weight.normal_(1, 0.3)
    # One projection output split as forward() splits it: strided views of a wider row.
    projected = torch.randn(batch, layer.conv_dim + layer.value_dim + 2 * heads + 3) * 2
    rows, z, b, a = projected[:, :-3].split([layer.conv_dim, layer.value_dim, heads, heads], dim=-1)
    a[0, 0] = 25.0  # softplus's linear branch (torch: threshold 20)
    # The vectorised SiLU (of the conv output and of the gate z) at the ends of exp's float range.
    z[0, :8] = torch.tensor([-200.0, -89.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0])
    rows[0, :2 * layer.num_k_heads * layer.head_k_dim] *= 60  # q, k: l2-normalised after the SiLU
    neg_rate, dt_bias = -layer.A_log.exp(), layer.dt_bias.detach()
    index = torch.tensor(slots)
    conv_native, rec_native = conv.clone(), rec.clone()
    got = gdn_step.decode_gated(rows, conv_native, layer.conv1d.weight[:, 0, :], rec_native, index, a, b,
                                neg_rate.detach(), dt_bias, z, layer.norm.weight.detach(), layer.norm.eps,
                                layer.num_k_heads, layer.head_k_dim, layer.head_v_dim)
    with torch.no_grad():
        g, beta = layer._gates(a, b, neg_rate, dt_bias)
        out = layer._decode_rows(rows, g, beta, conv, rec, index, slot_range)
        expected = layer._norm(out, z, torch.float32)
    assert got is not None and got.shape == expected.shape == (batch, layer.value_dim)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(rec_native, rec, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_native, conv)
    assert gdn_step.decode_gated(rows, conv, layer.conv1d.weight[:, 0, :], rec, index, a, b, neg_rate.detach(),
                                 dt_bias, z[:, :-1], layer.norm.weight.detach(), layer.norm.eps, layer.num_k_heads,
                                 layer.head_k_dim, layer.head_v_dim) is None  # a gate that does not fit: declined


def test_gdn_kernel_declines_other_dtypes():
    layer, conv, rec = _layer_and_pools(2, seed=0)
    rows = torch.randn(1, layer.conv_dim, dtype=torch.bfloat16)
    g = beta = torch.zeros(1, layer.num_v_heads)
    assert gdn_step.decode(rows, conv, layer.conv1d.weight[:, 0, :], rec, torch.tensor([0]), g, beta,
                           layer.num_k_heads, layer.head_k_dim, layer.head_v_dim) is None


@pytest.mark.usefixtures("kernel_variant")
@needs_kernels
def test_greedy_decode_with_native_kernels_equals_torch_paths(monkeypatch):
    """fp32, tiny model with every weight large enough for the skinny GEMM: same tokens, close logits."""
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    model = load_model("tiny")[0]
    assert model.fused_lm_head.skinny
    monkeypatch.setattr(native, "ENABLED", True)
    native_tokens, native_logits = _run(model, torch.float32, 20)
    monkeypatch.setattr(native, "ENABLED", False)
    torch_tokens, torch_logits = _run(model, torch.float32, 20)
    assert native_tokens == torch_tokens
    for a, b in zip(native_logits, torch_logits):
        assert torch.allclose(a, b, atol=1e-4)


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setattr(native, "ISA", "auto")  # the CPU's own pick, whatever CHUNKSCOPE_KERNEL_ISA forces
    assert native.why_unavailable({"avx2", "fma"}, "/usr/bin/g++") is None
    assert "avx2" in native.why_unavailable({"fma"}, "/usr/bin/g++")
    assert "compiler" in native.why_unavailable({"avx2", "fma"}, None)


def test_a_failed_build_logs_once_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("CHUNKSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(native, "ISA", "auto")  # the avx2 pick of that CPU, whatever CHUNKSCOPE_KERNEL_ISA forces
    native.clear_caches()
    try:
        with caplog.at_level(logging.WARNING, logger="chunkscope.kernels"):
            assert native.load("skinny_gemm") is None
            assert native.load("skinny_gemm") is None
        assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
            "native kernel skinny_gemm (avx2) unavailable (build failed: /bin/false exited 1): using the torch path"]
        assert not list(tmp_path.glob("kernels/*.so"))
    finally:
        native.clear_caches()


@needs_kernels
def test_compiled_graphs_trace_the_torch_paths(monkeypatch):
    """Under torch.compile the kernels step aside without a graph break (fullgraph), and results still match."""
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    linear = layers.FusedLinear(torch.randn(96, 40))
    x = torch.randn(8, 40)
    assert linear.runs_native(x)
    compiled = torch.compile(lambda t: linear(t), backend="eager", fullgraph=True)
    assert torch.allclose(compiled(x), F.linear(x, linear.weight), atol=1e-5)

    layer, conv, rec = _layer_and_pools(2, seed=0)
    rows = torch.randn(1, layer.conv_dim)
    g = beta = torch.zeros(1, layer.num_v_heads)

    def step(rows):
        out = gdn_step.decode(rows, conv, layer.conv1d.weight[:, 0, :], rec, torch.tensor([0]), g, beta,
                              layer.num_k_heads, layer.head_k_dim, layer.head_v_dim)
        return rows if out is None else out

    assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(rows), rows)
