"""InnerQ's numbers and bookkeeping without a model: groups, packing, windows, calibration, byte budget."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.kv import KVCacheExhausted
from engine.cache.kv_budget import ByteBudgetBlockManager
from engine.cache.kv_calibration import (STATE_APPLIED, STATE_CALIBRATING, STATE_READY, KeyCalibration,
                                         channel_scales, next_state)
from engine.cache.kv_quant import (InnerQConfig, blocks_to_quantize, config_for, dequantize, pack,
                                   quant_block_bytes, quantize, unpack)
from engine.cache.sequence import SequenceState


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), seed=st.integers(0, 10_000), shift=st.floats(-3, 3),
       spread=st.floats(1e-3, 20))
def test_round_trip_error_is_within_half_a_step(bits, seed, shift, spread):
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(seed)) * spread + shift  # [T, H, D]
    codes, scale, zero = quantize(x, bits, 32)
    assert codes.dtype == torch.uint8 and codes.shape == (5, 3, 64 * bits // 8)
    assert scale.shape == zero.shape == (5, 3, 2)
    back = dequantize(codes, scale, zero, bits, 32)
    step = scale.float().repeat_interleave(32, dim=-1)
    # half a step, plus the fp16 rounding of the zero point (relative, or absolute when subnormal)
    bound = step / 2 + zero.float().abs().repeat_interleave(32, dim=-1) * 2 ** -11 + 2 ** -24 + 1e-7
    assert bool(((back - x).abs() <= bound).all())


def test_four_bit_codes_are_packed_two_to_a_byte():
    codes = torch.tensor([[1, 15, 0, 7, 9, 3]], dtype=torch.uint8)
    packed = pack(codes, 4)
    assert packed.tolist() == [[1 | 15 << 4, 0 | 7 << 4, 9 | 3 << 4]]
    assert torch.equal(unpack(packed, 4), codes)


def test_each_group_chooses_symmetric_or_asymmetric_from_its_own_stats():
    balanced = torch.linspace(-1, 1, 32)
    one_sided = torch.linspace(0.5, 1.5, 32)
    x = torch.cat([balanced, one_sided])[None]  # one token, two groups
    codes, scale, zero = quantize(x, 4, 32)
    # symmetric: zero point exactly -8 steps, so 0.0 is a code; asymmetric: the zero point is the minimum
    assert float(zero[0, 0]) == -8 * float(scale[0, 0])
    assert float(zero[0, 1]) == pytest.approx(0.5, abs=1e-3)
    back = dequantize(codes, scale, zero, 4, 32)
    assert float((back[0, 32:] - one_sided).abs().max()) <= float(scale[0, 1]) / 2 + 1e-3
    assert quantize(torch.zeros(1, 32), 4, 32)[1].float().min() > 0, "a constant group gets a usable scale"


def test_quantized_block_bytes_and_config_checks():
    cfg = InnerQConfig(bits=4, group_size=32)
    # 1 layer, 16 tokens, 2 heads, D 64: codes 32 B + 2 groups * (scale + zero) * 2 B = 40 B per token-head, K and V
    assert quant_block_bytes(1, 16, 2, 64, cfg) == 2 * 16 * 2 * 40
    assert config_for("auto") is None and config_for("innerq8").bits == 8
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        config_for("int3")
    with pytest.raises(ValueError, match="recent"):
        config_for("innerq4", recent_tokens=0)
    with pytest.raises(ValueError, match="kv-group-size 24 does not divide"):
        InnerQConfig(bits=4, group_size=24).for_head_dim(64)
    assert InnerQConfig(bits=4, group_size=64).for_head_dim(32).group_size == 32


@pytest.mark.parametrize("before, after, expected", [
    (0, 40, range(0)),          # 40 - 32 = 8 tokens before the window: no whole block yet
    (0, 64, range(1, 2)),       # block 0 is the sink, block 1 left the window
    (64, 65, range(0)),         # window start 33: still inside block 2
    (64, 80, range(1, 3)),      # window start 48: block 2 left (1 was already out: callers skip it)
    (0, 200, range(1, 10)),
])
def test_blocks_leave_the_windows_at_block_granularity(before, after, expected):
    assert blocks_to_quantize(before, after, 16, sink_tokens=16, recent_tokens=32) == expected


def test_calibration_states_and_scales():
    assert next_state(STATE_CALIBRATING, 10, 64) == STATE_CALIBRATING
    assert next_state(STATE_CALIBRATING, 64, 64) == STATE_READY
    assert next_state(STATE_READY, 0, 64) == STATE_APPLIED
    assert next_state(STATE_APPLIED, 0, 64) == STATE_APPLIED
    cal = KeyCalibration([3], num_kv_heads=1, head_dim=4, calib_tokens=8)
    keys = torch.tensor([[[10.0, 1.0, 1.0, 0.0]]]).repeat(8, 1, 1)  # [T, Hkv, D]: channel 0 is an outlier
    cal.observe(3, keys[:4])
    assert cal.poll() is None and cal.tokens_seen == 4
    cal.observe(3, keys[4:])
    assert cal.poll() == (STATE_CALIBRATING, STATE_READY)
    scales = cal.scales[3][0]
    assert scales[0] > 3 * scales[1] and scales[3] == pytest.approx(1e-2)  # a dead channel is clamped
    cal.observe(3, keys)  # no longer calibrating: ignored
    assert cal.tokens_seen == 8
    assert cal.poll() == (STATE_READY, STATE_APPLIED) and cal.poll() is None
    assert channel_scales(torch.ones(2, 4) * 9, 1).tolist() == [[1.0] * 4] * 2


def test_normalization_folded_into_the_query_keeps_every_dot_product():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 64, generator=g), torch.randn(9, 64, generator=g) * torch.linspace(0.1, 8, 64)
    s = channel_scales(k.square().sum(0)[None], 9)[0]
    assert torch.allclose((q * s) @ (k / s).T, q @ k.T, atol=1e-4)
    # and it is why it exists: 4-bit keys err less once the outlier channels are evened out
    plain = dequantize(*quantize(k, 4, 32), 4, 32)
    normalized = dequantize(*quantize(k / s, 4, 32), 4, 32) * s
    assert float((q @ (normalized - k).T).abs().mean()) < float((q @ (plain - k).T).abs().mean())


FP, Q = 100, 25


def budget_manager(budget: int = 1000) -> ByteBudgetBlockManager:
    return ByteBudgetBlockManager(budget, fp_block_bytes=FP, quant_block_bytes=Q, block_size=4)


def test_the_budget_counts_formats_and_quantizing_frees_bytes():
    bm = budget_manager()
    assert bm.num_blocks == 40 and bm.num_fp_slots == 10 and bm.num_free == 10
    a = SequenceState(0)
    bm.allocate(a, 40)  # 10 full-precision blocks: the budget is full
    assert bm.num_free == 0 and bm.bytes_used == 1000
    with pytest.raises(KVCacheExhausted):
        bm.allocate(SequenceState(1), 1)
    bm.quantize_new_blocks = True
    b = SequenceState(1)
    bm.free(a)
    bm.allocate(b, 40)
    for block in b.block_table[:8]:
        bm.mark_quantized(block)
    assert bm.bytes_used == 8 * Q + 2 * FP and bm.num_free == (1000 - 8 * Q - 2 * FP) // FP
    with pytest.raises(ValueError):
        bm.mark_quantized(b.block_table[0])  # already quantized
    bm.check_invariants()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "quant", "free", "retain_free", "share"]),
                          st.integers(0, 5), st.integers(1, 12)), max_size=40))
def test_random_operations_keep_bytes_ids_and_slots_consistent(ops):
    bm = budget_manager(1200)
    bm.quantize_new_blocks = True
    seqs = {i: SequenceState(i) for i in range(6)}
    kept: list[int] = []   # evictable blocks a later sequence may share
    for op, i, n in ops:
        seq = seqs[i]
        if op == "alloc":
            if bm.can_allocate(seq, n):
                bm.allocate(seq, n)
                seq.num_cached_tokens += n
        elif op == "quant":
            for block in seq.block_table[:-1]:
                if bm.is_quantizable(block):
                    bm.mark_quantized(block)
        elif op in ("free", "retain_free"):
            if op == "retain_free":
                for block in seq.block_table:
                    bm.retain(block)
                kept = list(seq.block_table)
            bm.free(seq)
        elif op == "share" and not seq.block_table:
            alive = [b for b in kept if bm.ref_count(b) > 0 or bm.is_retained(b)]
            if alive and bm.can_share(alive):
                bm.share(seq, alive)
                seq.num_cached_tokens = len(alive) * 4
        bm.check_invariants()
    for seq in seqs.values():
        bm.free(seq)
    bm.check_invariants()
    assert bm.bytes_used == 0
