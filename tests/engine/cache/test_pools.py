"""The caches one engine runs on (``CachePools``): built for a model in blocks or bytes, sequences
admitted and released, a forward's blocks taken all together or not at all."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.kv import KVCacheExhausted
from engine.cache.kv_quant import config_for
from engine.cache.pools import CachePools
from engine.cache.sequence import SequenceState
from engine.cache.ssm_pool import SSMPoolExhausted
from engine.model.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")[0]


def test_built_in_blocks_or_bytes(tiny):
    pools = CachePools.build(tiny, 8, 2)
    assert pools.blocks.num_blocks == 8 and pools.ssm.num_slots == 2 and pools.innerq is None
    assert pools.kv_bytes_total == 8 * pools.fp_block_bytes and pools.kv_bytes_used == 0
    assert pools.kv_quant_state == "off" and pools.poll_kv_quant() is None
    by_bytes = CachePools.build(tiny, 1, 1, kv_budget_bytes=5 * pools.fp_block_bytes + 7)
    assert by_bytes.blocks.num_blocks == 5
    with pytest.raises(ValueError, match="hold no KV block"):
        CachePools.build(tiny, 8, 1, kv_budget_bytes=pools.fp_block_bytes - 1)


def test_an_innerq_cache_holds_more_blocks_in_the_same_bytes(tiny):
    full = CachePools.build(tiny, 16, 1)
    quant = CachePools.build(tiny, 16, 1, kv_quant=config_for("innerq4"))
    assert quant.innerq is not None and quant.blocks is quant.innerq.manager
    assert quant.kv_bytes_total == full.kv_bytes_total and quant.blocks.num_blocks > full.blocks.num_blocks
    assert quant.kv_quant_state == "calibrating"


def test_scratch_block_and_slot_for_a_compiled_step(tiny):
    pools = CachePools.build(tiny, 4, 2, scratch=True)
    assert pools.ssm.scratch_slot_id == 2
    assert pools.blocks.num_blocks == 4   # the scratch block is the store's, never handed out


def test_admit_release_and_normalize(tiny):
    pools = CachePools.build(tiny, 8, 1)
    seq = SequenceState(request_id=3)
    with pytest.raises(ValueError, match="admit"):
        pools.normalize(seq)
    pools.admit(seq)
    assert seq.ssm_slot == 0 and pools.ssm.num_used == 1
    pools.ssm.recurrent[:, 0] = 1e6
    assert pools.normalize(seq) is True and pools.normalize(seq) is False
    with pytest.raises(SSMPoolExhausted):
        pools.admit(SequenceState(request_id=4))
    pools.allocate([(seq, 20)])
    assert pools.kv_bytes_used == 2 * pools.fp_block_bytes
    pools.release(seq)
    assert seq.ssm_slot is None and seq.block_table == [] and pools.ssm.num_used == 0 and pools.blocks.num_used == 0


@settings(max_examples=40, deadline=None)
@given(grow=st.lists(st.integers(1, 40), min_size=1, max_size=5), num_blocks=st.integers(1, 12))
def test_allocate_takes_every_sequences_blocks_or_none(grow, num_blocks):
    pools = small_pools(num_blocks)
    seqs = [SequenceState(request_id=i) for i in range(len(grow))]
    for seq in seqs:
        seq.block_table = []
    needed = sum(-(-n // 16) for n in grow)
    try:
        grown = pools.allocate(list(zip(seqs, grow)))
    except KVCacheExhausted:
        assert needed > num_blocks
        assert all(s.block_table == [] for s in seqs) and pools.blocks.num_used == 0
        return
    assert needed <= num_blocks and pools.blocks.num_used == needed
    pools.undo(grown)
    assert all(s.block_table == [] for s in seqs) and pools.blocks.num_used == 0
    pools.blocks.check_invariants()


def small_pools(num_blocks: int) -> CachePools:
    """Small pools without a model (hypothesis builds many)."""
    from engine.cache.kv import BlockManager
    from engine.cache.kv_store import KVStore
    from engine.cache.ssm_pool import SSMPool
    store = KVStore([0], num_blocks, 16, 1, 4, dtype=torch.float32, device="cpu")
    return CachePools(BlockManager(num_blocks, 16), store, SSMPool(1, 1, 4, 2, 1, 2, 2), 64)


def test_with_prefix_shares_the_caches(tiny):
    pools = CachePools.build(tiny, 8, 1)
    marker = object()
    view = pools.with_prefix(marker)
    assert view.prefix is marker and pools.prefix is None
    assert view.blocks is pools.blocks and view.ssm is pools.ssm and view.kv_store is pools.kv_store
