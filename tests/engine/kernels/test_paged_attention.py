"""The native paged decode attention (engine/kernels/paged_attention) against the gather + SDPA path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native, paged_attention
from tests.engine.kernel_marks import needs_kernels as needs_kernels_of

needs_kernel = needs_kernels_of(paged_attention)


def _reference(q, keys, values, tables, lens, gate):
    """Gather each row's blocks, mask past its context, SDPA, gate: what attention.py does without the kernel."""
    batch, heads, dim = q.shape
    k = keys.index_select(0, tables.reshape(-1)).view(batch, -1, *keys.shape[2:]).transpose(1, 2)  # [B, Hkv, S, D]
    v = values.index_select(0, tables.reshape(-1)).view(batch, -1, *values.shape[2:]).transpose(1, 2)
    visible = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible, enable_gqa=True)[:, :, 0]
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out.reshape(batch, heads * dim)


def _store(num_blocks, block_size, kv_heads, dim, gen):
    return (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen),
            torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen))


@pytest.mark.usefixtures("kernel_variant")
@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (8, 8, 16), (6, 2, 20), (16, 4, 64)])
@pytest.mark.parametrize("lens", [[1], [16, 17, 3, 40], [64] * 5 + [1, 2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_gather_and_sdpa(heads, kv_heads, dim, lens, dtype):
    """float32: within float32 rounding of SDPA. bf16 (a bf16 model's store, q and gate): against SDPA in
    float32 over the same bf16 values, within the one rounding of the output (rtol 2^-8)."""
    gen = torch.Generator().manual_seed(heads * 100 + dim + len(lens))
    block_size, num_blocks = 16, 40
    keys, values = (t.to(dtype) for t in _store(num_blocks, block_size, kv_heads, dim, gen))
    width = max(2, max(-(-n // block_size) for n in lens)) + 1  # padded wider than any row needs
    # Each row's blocks scattered over the store (gapped, out of order); padding points at block 0.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([perm[(i * 3) % num_blocks:][:width] if len(perm[(i * 3) % num_blocks:]) >= width
                          else perm[:width] for i in range(len(lens))])
    context = torch.tensor(lens)
    q_gate = torch.randn(len(lens), heads, 2 * dim, generator=gen).to(dtype)
    q, gate = q_gate.split(dim, dim=-1)  # strided views, as attention.py hands them over
    tolerance = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-5)
    got = paged_attention.decode(q, keys, values, tables, context, gate)
    assert got is not None and got.shape == (len(lens), heads * dim) and got.dtype == dtype
    wide = (lambda t: t.float())
    want = _reference(wide(q), wide(keys), wide(values), tables, context, wide(gate))
    torch.testing.assert_close(got.float(), want, **tolerance)
    ungated = paged_attention.decode(q.contiguous(), keys, values, tables, context)
    want = _reference(wide(q), wide(keys), wide(values), tables, context, None)
    torch.testing.assert_close(ungated.float(), want, **tolerance)


@pytest.mark.usefixtures("kernel_variant")
@needs_kernel
def test_kernel_writes_bf16_rows_into_a_bf16_store_as_they_are():
    gen = torch.Generator().manual_seed(11)
    keys, values = (t.bfloat16() for t in _store(6, 16, 2, 32, gen))
    tables, lens, slots = torch.tensor([[3, 1], [0, 5]]), torch.tensor([18, 3]), torch.tensor([1 * 16 + 1, 0 * 16 + 2])
    new_k, new_v = torch.randn(2, 2, 32, generator=gen).bfloat16(), torch.randn(2, 2, 32, generator=gen).bfloat16()
    q = torch.randn(2, 4, 32, generator=gen).bfloat16()
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.view(-1, 2, 32)[slots], expected_values.view(-1, 2, 32)[slots] = new_k, new_v
    got = paged_attention.decode(q, keys, values, tables, lens, new_kv=(new_k, new_v, slots))
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    want = _reference(q.float(), keys.float(), values.float(), tables, lens, None)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)


@needs_kernel
def test_kernel_writes_the_rows_new_kv_before_attending():
    """new_kv: each row's own K/V lands at its slot (strided inputs, as the layer's projections give them)."""
    gen = torch.Generator().manual_seed(7)
    keys, values = _store(12, 16, 2, 32, gen)
    tables, lens = torch.tensor([[3, 9], [0, 11], [5, 2]]), torch.tensor([17, 32, 1])
    slots = torch.tensor([9 * 16 + 0, 11 * 16 + 15, 5 * 16 + 0])  # each row's last position
    qkv = torch.randn(3, 4 * 64 + 2 * 64, generator=gen)  # [q | gate | k | v] of a fused projection, strided
    q_gate, new_k, new_v = qkv.split([4 * 64, 64, 64], dim=-1)
    q, gate = q_gate.view(3, 4, 64).split(32, dim=-1)
    new_k, new_v = new_k.view(3, 2, 32), new_v.view(3, 2, 32)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.view(-1, 2, 32)[slots] = new_k
    expected_values.view(-1, 2, 32)[slots] = new_v
    expected = _reference(q, expected_keys, expected_values, tables, lens, gate)
    got = paged_attention.decode(q, keys, values, tables, lens, gate, new_kv=(new_k, new_v, slots))
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    before = keys.clone()
    with pytest.raises(ValueError, match="slot"):
        bad_slots = torch.tensor([0, 1, 12 * 16])  # one past the store
        paged_attention.decode(q, keys, values, tables, lens, gate, new_kv=(new_k, new_v, bad_slots))
    assert torch.equal(keys, before)  # a bad slot writes nothing


@needs_kernel
def test_kernel_rejects_tables_it_would_read_out_of_bounds():
    keys, values = _store(4, 16, 2, 32, torch.Generator().manual_seed(0))
    q = torch.randn(2, 4, 32)
    tables = torch.tensor([[0, 1], [2, 3]])
    assert paged_attention.decode(q, keys, values, tables, torch.tensor([32, 17])) is not None
    with pytest.raises(ValueError, match="context length|block id"):
        paged_attention.decode(q, keys, values, tables, torch.tensor([33, 1]))  # past the table
    with pytest.raises(ValueError, match="context length|block id"):
        paged_attention.decode(q, keys, values, tables, torch.tensor([0, 1]))  # nothing to attend to
    with pytest.raises(ValueError, match="context length|block id"):
        paged_attention.decode(q, keys, values, torch.tensor([[0, 1], [2, 4]]), torch.tensor([3, 20]))


def test_kernel_declines_what_it_does_not_cover(monkeypatch):
    keys, values = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([5])
    q = torch.randn(1, 4, 32)
    assert paged_attention.decode(q, keys.bfloat16(), values.bfloat16(), tables, lens) is None  # mixed dtypes
    assert paged_attention.decode(q.half(), keys.half(), values.half(), tables, lens) is None
    assert paged_attention.decode(q, keys.transpose(1, 2), values.transpose(1, 2), tables, lens) is None
    assert paged_attention.decode(torch.randn(1, 3, 32), keys, values, tables, lens) is None  # 3 heads over 2
    monkeypatch.setattr(native, "ENABLED", False)
    assert paged_attention.decode(q, keys, values, tables, lens) is None


@pytest.mark.usefixtures("kernel_variant")
@needs_kernel
def test_greedy_decode_with_the_kernel_equals_gather_and_sdpa(monkeypatch):
    """The tiny model over 20 decode steps at batch 3 (contexts crossing blocks): same tokens, close logits."""
    from engine.model.loader import load_model
    from tests.engine.model.test_decode_fastpaths import _run

    model = load_model("tiny")[0]
    calls = []
    kernel = paged_attention.decode

    def counted(*args, **kwargs):
        out = kernel(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(paged_attention, "decode", counted)
    kernel_tokens, kernel_logits = _run(model, torch.float32, 20)
    assert calls and all(calls)  # every decode forward's attention layer took the kernel
    monkeypatch.setattr(paged_attention, "decode", lambda *args, **kwargs: None)
    torch_tokens, torch_logits = _run(model, torch.float32, 20)
    assert kernel_tokens == torch_tokens
    for a, b in zip(kernel_logits, torch_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
