"""Paged KV block manager: allocation, freeing, cap, sharing, invariants."""
import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.cache.kv import BlockManager, KVCacheExhausted
from engine.cache.sequence import SequenceState


def test_num_blocks_for_is_ceil():
    bm = BlockManager(8, block_size=4)
    assert [bm.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_covers_cached_plus_new_tokens():
    bm = BlockManager(8, block_size=4)
    seq = SequenceState(request_id=1)
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    seq.num_cached_tokens = 5
    bm.allocate(seq, 3)  # 8 tokens still fit in 2 blocks
    assert len(seq.block_table) == 2
    bm.allocate(seq, 4)  # 9 tokens need a third
    assert len(seq.block_table) == 3
    assert (bm.num_used, bm.num_free) == (3, 5)
    bm.check_invariants()


def test_free_returns_blocks_and_resets_sequence():
    bm = BlockManager(4, block_size=2)
    seq = SequenceState(request_id=7)
    bm.allocate(seq, 5)
    seq.num_cached_tokens = 5
    assert bm.free(seq) == 3
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert (bm.num_used, bm.num_free) == (0, 4)
    assert bm.free(seq) == 0  # freeing twice is harmless
    bm.check_invariants()


def test_exhaustion_message_and_no_state_change():
    bm = BlockManager(4, block_size=2)
    a, b = SequenceState(1), SequenceState(2)
    bm.allocate(a, 6)
    before = (list(a.block_table), bm.num_used, bm.num_free)
    assert not bm.can_allocate(b, 4)
    with pytest.raises(KVCacheExhausted, match=r"^KV cache exhausted: need 2 more blocks, 1 free of 4 usable"):
        bm.allocate(b, 4)
    assert b.block_table == [] and (list(a.block_table), bm.num_used, bm.num_free) == before
    bm.check_invariants()


def test_cap_stops_new_allocations_without_freeing():
    bm = BlockManager(10, block_size=1)
    a = SequenceState(1)
    bm.allocate(a, 6)
    bm.set_cap(4)
    assert bm.num_usable == 4 and bm.num_used == 6 and bm.num_free == 0
    assert len(a.block_table) == 6
    with pytest.raises(KVCacheExhausted):
        bm.allocate(SequenceState(2), 1)
    bm.free(a)
    assert bm.num_free == 4
    bm.set_cap(None)
    assert bm.num_usable == 10
    bm.set_cap(50)
    assert bm.num_usable == 10
    bm.check_invariants()


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True])
def test_bad_cap_is_rejected(bad):
    with pytest.raises(ValueError, match="cap"):
        BlockManager(4).set_cap(bad)


@pytest.mark.parametrize("kwargs", [dict(num_blocks=0), dict(num_blocks=4, block_size=0)])
def test_bad_sizes_are_rejected(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


def test_two_states_with_one_request_id_are_refused():
    bm = BlockManager(4, block_size=2)
    bm.allocate(SequenceState(1), 2)
    with pytest.raises(ValueError, match="request id 1"):
        bm.allocate(SequenceState(1), 2)


def test_request_id_is_reusable_once_its_blocks_are_undone():
    bm = BlockManager(4, block_size=2)
    old = SequenceState(1)
    bm.allocate(old, 3)
    while old.block_table:  # the runner's rollback of a failed multi-sequence allocation
        bm.decref(old.block_table.pop())
    new = SequenceState(1)
    bm.allocate(new, 2)
    assert len(new.block_table) == 1
    bm.check_invariants()


def test_check_invariants_catches_a_tampered_table():
    bm = BlockManager(4, block_size=2)
    a, b = SequenceState(1), SequenceState(2)
    bm.allocate(a, 2)
    bm.allocate(b, 2)
    b.block_table.append(a.block_table[0])  # two owners, no shared reference
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_invariants()


def test_retained_block_becomes_evictable_and_is_reclaimed_lru():
    bm = BlockManager(3, block_size=1)
    evicted = []
    bm.on_evict = evicted.append
    a, b, c = SequenceState(1), SequenceState(2), SequenceState(3)
    bm.allocate(a, 1)
    bm.allocate(b, 1)
    bm.allocate(c, 1)
    for seq in (a, b, c):
        bm.retain(seq.block_table[0])
    ids = [s.block_table[0] for s in (a, b, c)]
    assert bm.free(b) == 1 and bm.free(a) == 1  # b's block is older than a's
    assert bm.num_free == 2 and bm.num_evictable == 2
    bm.allocate(SequenceState(4), 1)
    assert evicted == [ids[1]] and bm.num_evictions == 1
    bm.check_invariants()


def test_share_revives_an_evictable_block():
    bm = BlockManager(2, block_size=1)
    a = SequenceState(1)
    bm.allocate(a, 1)
    block = a.block_table[0]
    bm.retain(block)
    bm.free(a)
    b = SequenceState(2)
    bm.share(b, [block])
    assert b.block_table == [block] and bm.ref_count(block) == 1 and bm.num_evictable == 0
    c = SequenceState(3)
    bm.share(c, [block])
    assert bm.ref_count(block) == 2 and bm.num_used == 1
    bm.check_invariants()
    with pytest.raises(ValueError, match="no cached contents"):
        bm.share(SequenceState(4), [1 - block])


class BlockMachine(RuleBasedStateMachine):
    """Random allocate / append / free / cap / retain / share streams."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, block_size=4)
        self.seqs: dict[int, SequenceState] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(0, 20))
    def start(self, num_tokens):
        seq = SequenceState(self.next_id)
        self.next_id += 1
        self._allocate(seq, num_tokens)
        self.seqs[seq.request_id] = seq

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), num_tokens=st.integers(0, 9))
    def append(self, data, num_tokens):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        seq.num_cached_tokens = len(seq.block_table) * self.bm.block_size - data.draw(st.integers(0, 3)) \
            if seq.block_table else 0
        seq.num_cached_tokens = max(0, seq.num_cached_tokens)
        self._allocate(seq, num_tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        used_before = self.bm.num_used
        released = self.bm.free(seq)
        assert self.bm.num_used == used_before - released

    @rule(cap=st.one_of(st.none(), st.integers(0, 16)))
    def set_cap(self, cap):
        used_before = self.bm.num_used
        self.bm.set_cap(cap)
        assert self.bm.num_used == used_before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def retain(self, data):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        if seq.block_table:
            self.bm.retain(data.draw(st.sampled_from(seq.block_table)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def share(self, data):
        donor = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        blocks = donor.block_table[: data.draw(st.integers(0, len(donor.block_table)))]
        seq = SequenceState(self.next_id)
        self.next_id += 1
        self.bm.share(seq, blocks)
        self.seqs[seq.request_id] = seq

    def _allocate(self, seq, num_tokens):
        snapshot = (copy.deepcopy(self.bm.__dict__ | {"on_evict": None}), list(seq.block_table))
        if self.bm.can_allocate(seq, num_tokens):
            self.bm.allocate(seq, num_tokens)
            wanted = self.bm.num_blocks_for(seq.num_cached_tokens + num_tokens)
            assert len(seq.block_table) >= wanted
        else:
            with pytest.raises(KVCacheExhausted):
                self.bm.allocate(seq, num_tokens)
            after = (copy.deepcopy(self.bm.__dict__ | {"on_evict": None}), list(seq.block_table))
            assert after == snapshot

    @invariant()
    def holds(self):
        self.bm.check_invariants()
        owners: dict[int, int] = {}
        for seq in self.seqs.values():
            for block_id in seq.block_table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block_id, count in owners.items():
            assert self.bm.ref_count(block_id) == count
        assert self.bm.num_used == len(owners)
        assert self.bm.num_used + self.bm.num_free == max(self.bm.num_usable, self.bm.num_used)


BlockMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockMachine = BlockMachine.TestCase
