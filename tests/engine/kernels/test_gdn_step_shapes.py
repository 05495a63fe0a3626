"""The fused GDN decode kernel over the layer shapes it must cover: SmolLM-size heads (Dk = Dv = 64),
conv kernels other than 4 (the specialised K = 4 path and the generic one), Dv with a column tail,
batches whose rows prefetch each other's state."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kernels import gdn_step
from engine.model.gdn import GatedDeltaNet
from engine.model.tiny import TINY_CONFIG
from tests.engine.kernel_marks import needs_kernels as needs_kernels_of

needs_kernels = needs_kernels_of(gdn_step)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@needs_kernels
@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim, conv_kernel", [
    (4, 8, 64, 64, 4),   # SmolLM-size
    (2, 4, 32, 40, 4),   # Dv = 32 + an 8-column tail
    (2, 2, 16, 24, 3),   # the generic conv path, Dv below one 32-column block
    (1, 3, 8, 32, 5),
    (2, 4, 32, 32, 1),   # no conv state at all
])
@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("slots", [[5, 0, 3, 7, 1, 2, 6, 4], [2]])
def test_gdn_gated_kernel_equals_torch_path_over_shapes(key_heads, value_heads, key_dim, value_dim, conv_kernel,
                                                        slots):
    config = dataclasses.replace(TINY_CONFIG, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                                 linear_key_head_dim=key_dim, linear_value_head_dim=value_dim,
                                 linear_conv_kernel_dim=conv_kernel)
    torch.manual_seed(len(slots) + conv_kernel)
    layer = GatedDeltaNet(config, 0)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.normal_(0, 1)
        layer.dt_bias.normal_(0, 1)
        layer.norm.weight.normal_(1, 0.3)
    conv = torch.randn(8, layer.conv_dim, conv_kernel - 1)
    rec = torch.randn(8, value_heads, key_dim, value_dim) * 0.3
    batch = len(slots)
    projected = torch.randn(batch, layer.conv_dim + layer.value_dim + 2 * value_heads + 3) * 2
    rows, z, b, a = projected[:, :-3].split([layer.conv_dim, layer.value_dim, value_heads, value_heads], dim=-1)
    neg_rate, dt_bias = -layer.A_log.detach().exp(), layer.dt_bias.detach()
    index = torch.tensor(slots)
    weight = layer.conv1d.weight[:, 0, :].detach()
    conv_native, rec_native = conv.clone(), rec.clone()
    got = gdn_step.decode_gated(rows, conv_native, weight, rec_native, index, a, b, neg_rate, dt_bias, z,
                                layer.norm.weight.detach(), layer.norm.eps, key_heads, key_dim, value_dim)
    with torch.no_grad():
        g, beta = layer._gates(a, b, neg_rate, dt_bias)
        out = layer._decode_rows(rows, g, beta, conv, rec, index, None)
        expected = layer._norm(out, z, torch.float32)
    assert got is not None and got.shape == expected.shape == (batch, layer.value_dim)
    assert torch.allclose(got, expected, rtol=1e-5, atol=2e-5)
    assert torch.allclose(rec_native, rec, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_native, conv)  # the conv state is only shifted: exact
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(rec_native[untouched], rec[untouched]) and torch.equal(conv_native[untouched], conv[untouched])
