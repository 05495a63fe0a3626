"""SSM pool: slots never have two owners, counts add up, snapshots restore exactly."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.cache.ssm_pool import SSMPool, SSMPoolExhausted


def make_pool(num_slots: int = 4) -> SSMPool:
    return SSMPool(num_slots, num_linear_layers=2, conv_dim=6, conv_kernel=4, num_value_heads=2,
                   key_head_dim=3, value_head_dim=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 7)), max_size=60))
def test_pool_never_double_assigns(ops):
    pool = make_pool(4)
    owned: list[int] = []
    for op, pick in ops:
        if op == "alloc":
            if pool.num_free == 0:
                with pytest.raises(SSMPoolExhausted):
                    pool.allocate()
            else:
                slot = pool.allocate()
                assert slot not in owned
                owned.append(slot)
        elif owned:
            pool.free(owned.pop(pick % len(owned)))
        pool.check_invariants()
        assert pool.num_used == len(owned)
        assert pool.num_used + pool.num_free == pool.num_slots


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2 ** 31 - 1))
def test_snapshot_restore_is_exact(seed):
    pool = make_pool(3)
    a, b = pool.allocate(), pool.allocate()
    generator = torch.Generator().manual_seed(seed)
    pool.conv[:, a] = torch.randn(pool.conv[:, a].shape, generator=generator)
    pool.recurrent[:, a] = torch.randn(pool.recurrent[:, a].shape, generator=generator)
    snap = pool.snapshot(a)
    expected_conv, expected_rec = pool.conv[:, a].clone(), pool.recurrent[:, a].clone()
    pool.recurrent[:, a].mul_(3.0)  # the snapshot is a copy: later writes must not leak into it
    pool.conv[:, a].zero_()
    pool.restore(snap, b)
    assert torch.equal(pool.conv[:, b], expected_conv) and torch.equal(pool.recurrent[:, b], expected_rec)
    pool.restore(snap, a)
    assert torch.equal(pool.recurrent[:, a], expected_rec)


def test_allocate_gives_zero_state_and_free_checks_owner():
    pool = make_pool(1)
    slot = pool.allocate()
    pool.recurrent[:, slot].fill_(5.0)
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)
    slot = pool.allocate()
    assert pool.recurrent[:, slot].abs().sum() == 0 and pool.conv[:, slot].abs().sum() == 0
    with pytest.raises(SSMPoolExhausted, match="SSM pool exhausted"):
        pool.allocate()


def test_normalize_reports_whether_it_acted():
    pool = make_pool(2)
    slot = pool.allocate()
    assert pool.normalize(slot, 1.0) is False  # zero state is within any bound
    pool.recurrent[0, slot, 1].fill_(10.0)
    assert pool.normalize(slot, 1.0) is True
    norms = torch.linalg.vector_norm(pool.recurrent[:, slot], dim=(-2, -1))
    assert norms.max().item() == pytest.approx(1.0, rel=1e-5)
    pool.recurrent[1, slot, 0, 0, 0] = float("nan")
    assert pool.normalize(slot, 1.0) is True and torch.isfinite(pool.recurrent).all()
    with pytest.raises(ValueError, match="max_norm"):
        pool.normalize(slot, 0.0)
