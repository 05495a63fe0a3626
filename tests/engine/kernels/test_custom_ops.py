"""The native kernels as torch custom ops (engine/kernels/custom_ops.py): the op checks torch runs on
registered ops, results equal to the kernels' Python entry points, and a compiled graph through them."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import custom_ops, gdn_step, native, paged_attention

needs_kernels = pytest.mark.skipif(
    native.why_unavailable(native._cpu_flags(), "g++") is not None
    or not all(custom_ops.load_kernels(cpu_operators=False)[k] for k in ("attention", "gdn")),
    reason="no AVX2/FMA CPU or no C++ compiler here")


def _attention_inputs(seed: int = 0, batch: int = 3):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    keys = torch.randn(9, block, kv_heads, dim, generator=gen)
    values = torch.randn(9, block, kv_heads, dim, generator=gen)
    tables = torch.tensor([[1, 5, 0], [7, 0, 0], [2, 3, 4]][:batch])
    lens = torch.tensor([20, 9, 40][:batch])
    last = [(row[(n - 1) // block], (n - 1) % block) for row, n in zip(tables.tolist(), lens.tolist())]
    slots = torch.tensor([blk * block + offset for blk, offset in last])  # each row's newest position
    q_gate = torch.randn(batch, heads, 2 * dim, generator=gen)
    q, gate = q_gate.split(dim, dim=-1)
    new_k, new_v = torch.randn(batch, kv_heads, dim, generator=gen), torch.randn(batch, kv_heads, dim, generator=gen)
    return q.contiguous(), new_k, new_v, keys, values, slots, tables, lens, gate


def _gdn_inputs(seed: int = 0, batch: int = 3):
    gen = torch.Generator().manual_seed(seed)
    layers, slots_total, kh, dk, vh, dv, kernel = 2, 6, 2, 32, 4, 32, 4
    channels = 2 * kh * dk + vh * dv
    conv = torch.randn(layers, slots_total, channels, kernel - 1, generator=gen)
    rec = 0.1 * torch.randn(layers, slots_total, vh, dk, dv, generator=gen)
    proj = torch.randn(batch, channels + vh * dv + 2 * vh, generator=gen)  # [mixed | z | b | a], as the layer's GEMM
    mixed, z, b, a = proj.split([channels, vh * dv, vh, vh], dim=-1)
    return (mixed, conv, rec, 1, torch.randn(channels, kernel, generator=gen), torch.tensor([4, 0, 2][:batch]), a, b,
            -torch.rand(vh, generator=gen), torch.rand(vh, generator=gen), z, torch.randn(dv, generator=gen), 1e-6,
            kh, dk, dv)


@needs_kernels
def test_ops_pass_torch_opcheck():
    """Schema (declared mutations), fake tensor implementation and functionalization, as torch checks them."""
    torch.library.opcheck(torch.ops.chunkscope.paged_decode_attention.default, _attention_inputs(),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    torch.library.opcheck(torch.ops.chunkscope.gdn_decode_gated.default, _gdn_inputs(),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@needs_kernels
def test_attention_op_writes_the_new_kv_then_equals_the_kernel():
    q, new_k, new_v, keys, values, slots, tables, lens, gate = _attention_inputs(1)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.view(-1, 2, 32)[slots] = new_k
    expected_values.view(-1, 2, 32)[slots] = new_v
    expected = paged_attention.decode(q, expected_keys, expected_values, tables, lens, gate)
    got = torch.ops.chunkscope.paged_decode_attention(q, new_k, new_v, keys, values, slots, tables, lens, gate)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert torch.equal(got, expected)


@needs_kernels
def test_gdn_op_updates_its_layer_of_the_pools_in_place_as_the_kernel_does():
    args = _gdn_inputs(2)
    mixed, conv, rec, layer, weight, slots, a, b, neg_rate, dt_bias, z, norm_weight, eps, kh, dk, dv = args
    conv_ref, rec_ref = conv.clone(), rec.clone()
    expected = gdn_step.decode_gated(mixed, conv_ref[layer], weight, rec_ref[layer], slots, a, b, neg_rate, dt_bias,
                                     z, norm_weight, eps, kh, dk, dv)
    got = torch.ops.chunkscope.gdn_decode_gated(*args)
    assert torch.equal(got, expected)
    assert torch.equal(conv, conv_ref) and torch.equal(rec, rec_ref)
    assert not torch.equal(rec[layer, 4], _gdn_inputs(2)[2][layer, 4])  # the state did move


@needs_kernels
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_function_through_both_ops_is_one_graph_and_mutates_its_inputs(backend):
    """aot_eager functionalizes the graph as inductor does: the in-place writes must land in the inputs."""
    att, gdn = _attention_inputs(3), _gdn_inputs(3)

    def step(att, gdn):
        out = custom_ops.paged_decode_attention_traced(*att)
        state = custom_ops.gdn_decode_gated_traced(*gdn)
        return out.sum() + state.sum()

    torch._dynamo.reset()
    eager_att, eager_gdn = _attention_inputs(3), _gdn_inputs(3)
    expected = torch.ops.chunkscope.paged_decode_attention(*eager_att).sum() + \
        torch.ops.chunkscope.gdn_decode_gated(*eager_gdn).sum()
    got = torch.compile(step, backend=backend, fullgraph=True)(att, gdn)
    torch.testing.assert_close(got, expected)
    for i in (3, 4):  # the store after the K/V write
        assert torch.equal(att[i], eager_att[i])
    for i in (1, 2):  # the SSM pools after the step
        assert torch.equal(gdn[i], eager_gdn[i])
