"""bf16 decode through the native kernels, in every variant: the skinny GEMM and SwiGLU on bf16 weights
(skinny_gemm.cpp's *_bf16) against float32 and torch's bf16 paths, the RMSNorm, the paged attention
and a GDN layer of a bf16 model through the float32 kernels (the GDN states are float32 whatever the
weights), and a speculative verify's GDN rows through the same step as decode.

bf16 weights and inputs, float32 sums, the output rounded once to bf16 (round to nearest even).
Stated tolerances, per element:
- against the float32 product of the same bf16 inputs: rtol 2^-8 (the one rounding of the output,
  at most an ulp where the float32 sum sits at a rounding boundary) plus atol 2e-6 sqrt(K) max|y|
  (float32 sums in another order);
- against torch's bf16 path: F.linear rounds once too (rtol 2^-7: the two roundings of close sums
  may land an ulp apart); torch's SwiGLU rounds the projection, SiLU and the product apart
  (three roundings: rtol 2^-6).
The avx512-bf16 and SIMDe builds multiply the pairs with vdpbf16ps; avx2 and avx512 widen them to
float32 FMAs (vec.h's PairW): both run here where the CPU can.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cache.sequence import SequenceState
from engine.kernels import gdn_step, native, paged_attention, skinny_gemm, swiglu_gemm
from engine.model import layers, norms
from engine.model.batch import build_batch
from engine.model.gdn import GatedDeltaNet, SSMRowStates
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.model.tiny import TINY_CONFIG
from tests.engine.model.test_decode_fastpaths import BF16_MAX_LOGIT_ERROR, _run
from tests.engine.kernel_marks import needs_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "kernel_variant"), needs_kernels(skinny_gemm, gdn_step)]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, inner: int) -> None:
    assert got.dtype == torch.bfloat16
    atol = 2e-6 * inner ** 0.5 * want.abs().max().item() + 1e-30
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 13, 32])
@pytest.mark.parametrize("out_cols, inner", [(3072, 576), (250, 1536), (33, 7), (7, 1), (48, 2)])
def test_bf16_skinny_gemm_equals_float32_and_torch(rows, out_cols, inner):
    gen = torch.Generator().manual_seed(rows * 31 + out_cols + inner)
    weight = torch.randn(out_cols, inner + 2, generator=gen)[:, :inner].bfloat16()  # a wider row stride
    bias = torch.randn(out_cols, generator=gen).bfloat16()
    x = torch.randn(rows, inner + 4, generator=gen).bfloat16()[:, 1:1 + inner]
    packed = skinny_gemm.pack(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-out_cols // 16), -(-inner // 2), 32)
    got = skinny_gemm.linear(x, packed, out_cols, bias)
    assert got is not None and got.shape == (rows, out_cols)
    _close(got, F.linear(x.float(), weight.float(), bias.float()), 2 ** -8, inner)
    _close(got, F.linear(x, weight, bias), 2 ** -7, inner)
    _close(skinny_gemm.linear(x, packed, out_cols), F.linear(x.float(), weight.float()), 2 ** -8, inner)


@pytest.mark.parametrize("rows", [1, 8, 13, 32])
@pytest.mark.parametrize("intermediate, inner", [(1536, 576), (20, 3), (5, 8)])
def test_bf16_swiglu_equals_float32_and_torch(rows, intermediate, inner):
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = torch.randn(2 * intermediate, inner, generator=gen).bfloat16()
    x = (torch.randn(rows, inner, generator=gen) * 2).bfloat16()
    packed = swiglu_gemm.pack(gate_up, intermediate)
    assert packed.shape == (-(-intermediate // 8), -(-inner // 2), 32)
    got = swiglu_gemm.swiglu(x, packed, intermediate)
    assert got is not None and got.shape == (rows, intermediate)
    gate, up = F.linear(x.float(), gate_up.float()).split(intermediate, dim=-1)
    _close(got, F.silu(gate) * up, 2 ** -8, inner)
    torch_gate, torch_up = F.linear(x, gate_up).split(intermediate, dim=-1)
    _close(got, F.silu(torch_gate) * torch_up, 2 ** -6, inner)


def test_bf16_packing_holds_k_pairs_per_column():
    weight = torch.arange(18 * 3, dtype=torch.float32).reshape(18, 3).bfloat16()  # exact in bf16
    packed = skinny_gemm.pack(weight)  # [2, 2, 32]: line i holds (W[n, 2i], W[n, 2i + 1]) of each column n
    assert packed.shape == (2, 2, 32)
    pairs = packed.view(2, 2, 16, 2)
    assert torch.equal(pairs[0, 0, :, 0], weight[:16, 0]) and torch.equal(pairs[0, 0, :, 1], weight[:16, 1])
    assert torch.equal(pairs[0, 1, :, 0], weight[:16, 2]) and not pairs[0, 1, :, 1].any()  # k padded to even
    assert torch.equal(pairs[1, :, :2, :].reshape(2, 4)[0, ::2], weight[16:, 0]) and not pairs[1, :, 2:].any()


def test_bf16_kernels_decline_mixed_dtypes():
    packed = skinny_gemm.pack(torch.randn(32, 16).bfloat16())
    assert skinny_gemm.linear(torch.randn(4, 16), packed, 32) is None  # float32 x, bf16 copy
    assert skinny_gemm.linear(torch.randn(4, 16).bfloat16(), packed, 32, torch.randn(32)) is None  # fp32 bias
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm.linear(torch.randn(4, 18).bfloat16(), packed, 32)


def test_a_bf16_fused_linear_and_mlp_route_decode_rows_to_the_kernel(monkeypatch):
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    mlp = layers.SwiGLU(64, 96).bfloat16()
    mlp.fuse()
    x = torch.randn(8, 64).bfloat16()
    assert mlp.fused_gate_up.runs_native(x) and mlp.fused_down.runs_native(torch.randn(8, 96).bfloat16())
    with torch.no_grad():
        got = mlp(x)
        gate, up, down = (p.weight.float() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        want = F.linear(F.silu(F.linear(x.float(), gate)) * F.linear(x.float(), up), down)  # float32 throughout
    # Two roundings (the [8, 96] activations, the output), the first carried through the down
    # projection's sum of 96 terms, which can cancel: an absolute bound at the output's scale.
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2 ** -6 * want.abs().max().item())


def test_a_bf16_rms_norm_runs_the_float32_kernel_and_rounds_once(monkeypatch):
    """bf16 decode rows widened for the native norm and rounded back: the torch path computes in float32
    and rounds once too, so they agree within one bf16 rounding (rtol 2^-8)."""
    norm = norms.ZeroCenteredRMSNorm(576, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.2)
    norm.fuse()
    x = (torch.randn(8, 576) * 3).bfloat16()
    calls, real = [], norms.rms_norm.rms_norm
    monkeypatch.setattr(norms.rms_norm, "rms_norm", lambda t, *args: calls.append(t.dtype) or real(t, *args))
    got = norm(x)
    assert calls == [torch.float32] and got.dtype == torch.bfloat16
    want = (norms._rms_normalize(x, 1e-6) * norm.scale).to(torch.bfloat16)  # the torch path, float32 inside
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-6)


def test_a_bf16_model_decodes_through_the_native_kernels(monkeypatch):
    """The tiny model in bf16, every weight on the skinny GEMM: each decode step's GDN and attention layers
    take the kernels, and the logits stay within the bf16 tolerance of the torch paths (test_decode_fastpaths'
    BF16_MAX_LOGIT_ERROR, teacher-forced on the same tokens)."""
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    model = load_model("tiny", dtype=torch.bfloat16)[0]
    assert model.fused_lm_head.skinny and model.fused_lm_head.skinny_packed.dtype == torch.bfloat16
    taken = {"gdn": [], "attention": []}
    for module, name, key in ((gdn_step, "decode_gated", "gdn"), (paged_attention, "decode", "attention")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _real=real, _key=key, **kwargs:
                            taken[_key].append(_real(*args, **kwargs)) or taken[_key][-1])
    tokens, native_logits = _run(model, torch.bfloat16, 6)
    assert taken["gdn"] and taken["attention"] and all(out is not None for outs in taken.values() for out in outs)
    monkeypatch.setattr(native, "ENABLED", False)
    _, torch_logits = _run(model, torch.bfloat16, 6, forced=tokens[:6])
    errors = [(a - b).abs().max().item() for a, b in zip(native_logits, torch_logits)]
    assert max(errors) <= BF16_MAX_LOGIT_ERROR, errors


def test_a_bf16_gdn_layer_decodes_through_the_float32_native_step():
    """bf16 rows widened, the float32 step on the float32 pools, the output rounded once: against the
    float32 tensor path on the same bf16 weights and rows (states within 1e-5, the output within one
    bf16 rounding, rtol 2^-8)."""
    torch.manual_seed(3)
    layer = GatedDeltaNet(TINY_CONFIG, 0)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.normal_(0, 1)
        layer.norm.weight.normal_(1, 0.3)
    layer = layer.bfloat16()
    layer.fuse()
    reference = GatedDeltaNet(TINY_CONFIG, 0)
    reference.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    batch, heads = 3, layer.num_v_heads
    projected = torch.randn(batch, layer.conv_dim + layer.value_dim + 2 * heads).bfloat16()
    rows, z, b, a = projected.split([layer.conv_dim, layer.value_dim, heads, heads], dim=-1)
    conv = torch.randn(5, layer.conv_dim, layer.conv_kernel - 1).bfloat16().float()  # bf16 inputs widened
    rec = torch.randn(5, heads, layer.head_k_dim, layer.head_v_dim) * 0.3
    slots = torch.tensor([4, 0, 2])
    neg_rate, dt_bias = layer.decay_rate
    conv_native, rec_native = conv.clone(), rec.clone()
    taken = []
    real = gdn_step.decode_gated
    gdn_step.decode_gated = lambda *args, **kwargs: taken.append(real(*args, **kwargs)) or taken[-1]
    try:
        got = layer._decode_normed(rows, z, b, a, neg_rate, dt_bias, layer.conv_weight, conv_native, rec_native,
                                   slots, None)  # what forward() runs for decode rows
    finally:
        gdn_step.decode_gated = real
    assert taken and taken[0] is not None and got.dtype == torch.bfloat16
    with torch.no_grad():
        g, beta = reference._gates(a, b, neg_rate, dt_bias)
        out = reference._decode_rows(rows.float(), g, beta, conv, rec, slots, None)
        want = reference._norm(out, z.float(), torch.float32)
    torch.testing.assert_close(rec_native, rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_native, conv, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_run_the_decode_steps_arithmetic(dtype):
    """A speculative verify's GDN rows (``ssm_row_states``) go through the decode step itself: on the same
    projected rows, the outputs and the state kept after each row are bit-equal to one decode step per row.
    (With bf16 decode on the widened float32 step and verify rows on bf16 tensor ops, served tokens
    depended on when speculation ran: --ep 2 drifted from --ep 1 in test_expert_parallel.)"""
    torch.manual_seed(5)
    layer = GatedDeltaNet(TINY_CONFIG, 0)
    with torch.no_grad():
        layer.A_log.normal_(0, 1)
        layer.norm.weight.normal_(1, 0.3)
    layer = layer.to(dtype)
    layer.fuse()
    num_rows, heads = 3, layer.num_v_heads
    projected = torch.randn(num_rows, layer.conv_dim + layer.value_dim + 2 * heads).to(dtype)
    rows, z, b, a = projected.split([layer.conv_dim, layer.value_dim, heads, heads], dim=-1)
    conv = torch.randn(1, layer.conv_dim, layer.conv_kernel - 1).to(dtype).float()  # as a pool holds them
    rec = torch.randn(1, heads, layer.head_k_dim, layer.head_v_dim) * 0.3
    neg_rate, dt_bias = layer.decay_rate
    window = torch.cat([conv[0].to(dtype), rows.t()], dim=-1)  # [C, K-1+R], as forward() builds it
    row_states = SSMRowStates()
    with torch.no_grad():
        verified, final = layer._prefill_every_row(window, rows, z, b, a, neg_rate, dt_bias, rec[0].clone(),
                                                   row_states)
        slot = torch.zeros(1, dtype=torch.long)
        for r in range(num_rows):
            one = slice(r, r + 1)
            decoded = layer._decode_normed(rows[one], z[one], b[one], a[one], neg_rate, dt_bias, layer.conv_weight,
                                           conv, rec, slot, (0, 1))
            assert torch.equal(verified[r], decoded[0]), r
            assert torch.equal(row_states.recurrent[0][r], rec[0]) and torch.equal(row_states.conv[0][r], conv[0])
    assert torch.equal(final, rec[0]) and verified.dtype == dtype
