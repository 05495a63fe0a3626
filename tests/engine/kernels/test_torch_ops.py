"""The C++ torch operators (engine/kernels/torch_ops.cpp): each equals its ctypes entry point bit for bit,
passes torch's operator checks, rejects bad input with a clear error, and a compiled decode step calls them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import custom_ops, native, skinny_gemm, swiglu_gemm
from engine.model.compiled_decode import CompileSettings
from engine.model.layers import FusedLinear, decode_projections
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState
from tests.engine.kernels.test_custom_ops import _attention_inputs, _gdn_inputs

needs_ops = pytest.mark.skipif(
    native.why_unavailable(native._cpu_flags(), native.compiler()) is not None
    or not custom_ops.load_kernels()["torch_ops"], reason="no AVX2/FMA CPU, no C++ compiler or no torch headers here")
ops = torch.ops.chunkscope_native


def _skinny_inputs(rows: int, inner: int, cols: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(cols, inner, generator=gen) * 0.05).to(dtype)
    # x as the layers see it: a column slice of a wider activation (row stride > inner).
    x = torch.randn(rows, inner + 8, generator=gen).to(dtype)[:, :inner]
    return x, weight, torch.randn(cols, generator=gen).to(dtype)


# float32 within float32 rounding of the library; bf16 within an ulp of torch's bf16 GEMM (both round once).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3)}


@needs_ops
@pytest.mark.parametrize("rows, inner, cols", [(1, 128, 392), (8, 128, 768), (32, 384, 128), (32, 128, 272),
                                               (5, 64, 17), (3, 32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_equals_the_ctypes_kernel_and_the_library(rows, inner, cols, dtype, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the ctypes entry point runs at 1 thread only
    x, weight, bias = _skinny_inputs(rows, inner, cols, dtype=dtype)
    packed = skinny_gemm.pack(weight)
    for b in (None, bias):
        got = ops.skinny_linear(x, packed, b, cols)
        assert got.dtype == dtype and torch.equal(got, skinny_gemm.linear(x, packed, cols, b))  # bit for bit
        torch.testing.assert_close(got, F.linear(x, weight, b), **TOLERANCE[dtype])


@needs_ops
@pytest.mark.parametrize("rows, inner, intermediate", [(1, 128, 384), (8, 64, 20), (32, 128, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_linear_equals_the_ctypes_kernel_and_the_torch_path(rows, inner, intermediate, dtype, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    x, gate_up, _ = _skinny_inputs(rows, inner, 2 * intermediate, seed=1, dtype=dtype)
    packed = swiglu_gemm.pack(gate_up, intermediate)
    got = ops.swiglu_linear(x, packed, intermediate)
    assert torch.equal(got, swiglu_gemm.swiglu(x, packed, intermediate))
    gate, up = F.linear(x.float(), gate_up.float()).split(intermediate, dim=-1)  # float32, then one rounding
    torch.testing.assert_close(got, (F.silu(gate) * up).to(dtype), **TOLERANCE[dtype])


@needs_ops
def test_ops_pass_torch_opcheck():
    """Schemas (declared mutations), the fake implementations and functionalization, as torch checks them."""
    x, weight, bias = _skinny_inputs(4, 64, 40)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(ops.skinny_linear.default, (x, skinny_gemm.pack(weight), bias, 40), test_utils=checks)
    torch.library.opcheck(ops.swiglu_linear.default, (x, swiglu_gemm.pack(weight, 20), 20), test_utils=checks)
    x16, weight16 = x.bfloat16(), weight.bfloat16()
    torch.library.opcheck(ops.skinny_linear.default, (x16, skinny_gemm.pack(weight16), bias.bfloat16(), 40),
                          test_utils=checks)
    torch.library.opcheck(ops.paged_decode_attention.default, _attention_inputs(), test_utils=checks)
    torch.library.opcheck(ops.gdn_decode_gated.default, _gdn_inputs(), test_utils=checks)


@needs_ops
def test_attention_and_gdn_ops_equal_the_python_ops_and_write_the_same_state():
    for make, name in ((_attention_inputs, "paged_decode_attention"), (_gdn_inputs, "gdn_decode_gated")):
        native_args, python_args = make(5), make(5)
        got = getattr(ops, name)(*native_args)
        expected = getattr(torch.ops.chunkscope, name)(*python_args)
        assert torch.equal(got, expected), name
        for a, b in zip(native_args, python_args):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), name  # the store / pools after the in-place writes


@needs_ops
def test_bad_inputs_raise_a_clear_error_and_write_nothing():
    x, weight, _ = _skinny_inputs(4, 64, 40)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.skinny_linear(x, skinny_gemm.pack(weight), None, 60)  # 3 panels of 16 columns, not 4
    with pytest.raises(RuntimeError, match="float32"):
        ops.skinny_linear(x.double(), skinny_gemm.pack(weight), None, 40)
    args = list(_attention_inputs(6))
    args[7] = torch.tensor([20, 9, 400])  # a context past the table
    keys_before = args[3].clone()
    with pytest.raises(RuntimeError, match="context length"):
        ops.paged_decode_attention(*args)
    assert torch.equal(args[3], keys_before)
    args = list(_gdn_inputs(6))
    args[5] = torch.tensor([4, 0, 99])  # a slot outside the pool
    rec_before = args[2].clone()
    with pytest.raises(RuntimeError, match="slot 99"):
        ops.gdn_decode_gated(*args)
    assert torch.equal(args[2], rec_before)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    return load_model("tiny", dtype=request.param)[0]


@needs_ops
def test_a_compiled_step_packs_each_decode_weight_once_and_calls_the_cpp_operators(tiny, monkeypatch):
    """fp32 and bf16 (bf16 copies for the GEMMs, attention over the bf16 store, a bf16 GDN layer's rows
    widened for the float32 step)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the skinny GEMM is single-threaded
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    dtype = next(tiny.parameters()).dtype
    runner = ModelRunner.build(tiny, num_kv_blocks=16, num_ssm_slots=3, dtype=dtype,
                               compile=CompileSettings("eager", buckets=(2,)))
    runner.compiled_decode._compiled = torch.compile(runner.compiled_decode._decode, backend=recording_backend,
                                                     dynamic=False)
    def packed_copy(projection):
        return projection.skinny_packed if isinstance(projection, FusedLinear) else projection.packed

    projections = [p for p in decode_projections(tiny) if getattr(p, "decode_rows", True)]
    packed = {id(p): packed_copy(p) for p in projections}
    assert projections and all(p is not None and p.dtype == dtype for p in packed.values())
    ModelRunner.build(tiny, num_kv_blocks=16, num_ssm_slots=3, dtype=dtype, compile=CompileSettings("eager", buckets=(2,)))
    assert all(packed_copy(p) is packed[id(p)] for p in projections)  # no second copy
    seqs = [SequenceState(i) for i in range(2)]
    for seq in seqs:
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, [3, 4, 5], 0, 3, True)
    runner.decode(seqs, [1, 2])
    code = "\n".join(graphs)
    # Every GEMM (3 per layer and the LM head; the MLP's gate/up with its SiLU product), each GDN step
    # and the attention: C++ operators.
    layers = tiny.config.num_hidden_layers
    assert code.count("chunkscope_native.skinny_linear") == 3 * layers + 1
    assert code.count("chunkscope_native.swiglu_linear") == layers
    assert code.count("chunkscope_native.gdn_decode_gated") == len(tiny.config.linear_attention_layers)
    assert code.count("chunkscope_native.paged_decode_attention") == len(tiny.config.full_attention_layers)
    assert "torch.ops.chunkscope." not in code


def test_an_eager_fused_linear_keeps_small_weights_on_the_library_gemm():
    weight = torch.randn(24, 16)
    linear = FusedLinear(weight)
    assert linear.skinny_packed is None  # small: no copy until a compiled step asks for one
    x = torch.randn(3, 16)
    torch.testing.assert_close(linear(x), F.linear(x, weight))
