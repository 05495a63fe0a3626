"""Prefix cache: chain-hash matching, sharing, LRU eviction, SSM snapshot cuts."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.cache.kv import BlockManager, KVCacheExhausted
from engine.cache.prefix import ROOT_HASH, PrefixCache, chain_hash
from engine.cache.sequence import SequenceState

BS = 4


def run_prompt(cache, request_id, prompt, snapshot_every_block=True):
    """Admit ``prompt`` as the engine would: match, attach, allocate the rest,
    'compute' it, publish its full blocks and a snapshot at each boundary."""
    seq = SequenceState(request_id)
    match = cache.match(prompt)
    cache.attach(seq, match)
    cache.block_manager.allocate(seq, len(prompt) - seq.num_cached_tokens)
    seq.num_cached_tokens = len(prompt)
    hashes = cache.register(seq, prompt, len(prompt))
    if snapshot_every_block:
        for h in hashes:
            cache.put_snapshot(h, f"snap-{h}")
    return seq, match


def test_chain_hash_depends_on_parent_and_tokens():
    h1 = chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert h1 != chain_hash(ROOT_HASH, [1, 2, 3, 5])
    assert chain_hash(h1, [5, 6, 7, 8]) != chain_hash(ROOT_HASH, [5, 6, 7, 8])


def test_match_attach_register_round_trip():
    cache = PrefixCache(BlockManager(16, BS))
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks
    first, miss = run_prompt(cache, 1, prompt)
    assert miss.num_tokens == 0 and miss.miss_reason == "no cached KV block at token 0 (matchable 12)"
    follow_up = prompt + [7, 8, 9]
    second, hit = run_prompt(cache, 2, follow_up)
    assert hit.num_tokens == 12 and hit.miss_reason == "no cached KV block at token 12 (matchable 16)"
    assert second.block_table[:3] == first.block_table[:3]
    assert hit.snapshot == f"snap-{hit.block_hashes[-1]}"
    assert [cache.block_manager.ref_count(b) for b in first.block_table[:3]] == [2, 2, 2]
    assert cache.stats.num_hits == 1 and cache.stats.num_hit_tokens == 12
    assert cache.stats.num_prompt_tokens == 14 + 17
    cache.check_invariants()


def test_match_leaves_at_least_one_token_to_compute():
    cache = PrefixCache(BlockManager(8, BS))
    prompt = list(range(8))
    run_prompt(cache, 1, prompt)
    match = cache.match(prompt)  # both blocks cached, but the last token must be computed
    assert match.num_tokens == 4
    assert cache.match(prompt[:4]).num_tokens == 0
    assert "no full block before its last token" in cache.match(prompt[:4]).miss_reason
    assert cache.match([]).num_tokens == 0


def test_missing_snapshot_cuts_the_match_and_says_why():
    cache = PrefixCache(BlockManager(16, BS))
    prompt = list(range(20))
    seq, _ = run_prompt(cache, 1, prompt, snapshot_every_block=False)
    hashes = cache.chain_hashes(prompt)
    cache.put_snapshot(hashes[2], "at-12")  # snapshots only at token 12
    match = cache.match(prompt + [99])
    assert (match.num_kv_tokens, match.num_tokens, match.snapshot) == (20, 12, "at-12")
    assert match.miss_reason == "no SSM snapshot at token 20 (KV matched 20, deepest snapshot at token 12)"
    none = PrefixCache(BlockManager(4, BS))
    s2 = SequenceState(1)
    none.block_manager.allocate(s2, 8)
    s2.num_cached_tokens = 8
    none.register(s2, prompt[:8], 8)
    assert none.match(prompt[:9]).miss_reason.startswith("no SSM snapshot at token 8")
    assert none.match(prompt[:9]).num_tokens == 0


def test_pure_attention_model_needs_no_snapshot():
    cache = PrefixCache(BlockManager(16, BS), needs_ssm_snapshot=False)
    prompt = list(range(10))
    run_prompt(cache, 1, prompt, snapshot_every_block=False)
    match = cache.match(prompt)
    assert match.num_tokens == 8 and match.snapshot is None and match.miss_reason is None


def test_hash_collision_cannot_alias_other_tokens():
    cache = PrefixCache(BlockManager(8, BS))
    prompt = [1, 2, 3, 4, 5]
    run_prompt(cache, 1, prompt)
    # Forge a collision: the stored key now names different tokens.
    h = cache.chain_hashes(prompt)[0]
    cache._by_hash[h].tokens = (9, 9, 9, 9)
    assert cache.match(prompt).num_tokens == 0


def test_evicts_least_recently_used_and_drops_snapshots():
    bm = BlockManager(4, BS)
    cache = PrefixCache(bm)
    dropped = []
    cache.add_evict_listener(lambda h, handle: dropped.append(handle))
    a, _ = run_prompt(cache, 1, list(range(0, 4)))
    b, _ = run_prompt(cache, 2, list(range(10, 14)))
    c, _ = run_prompt(cache, 3, list(range(20, 24)))
    ha, hb = cache.chain_hashes(list(range(0, 4)))[0], cache.chain_hashes(list(range(10, 14)))[0]
    for seq in (a, b, c):
        bm.free(seq)
    assert bm.num_evictable == 3 and bm.num_free == 4
    # Reuse a's block: it becomes most recently used, so b's goes first.
    d, hit = run_prompt(cache, 4, list(range(0, 4)) + [5])
    assert hit.num_tokens == 4
    bm.free(d)
    bm.allocate(SequenceState(5), 8)  # one truly free block + one eviction
    assert dropped == [f"snap-{hb}"]
    assert not cache.is_cached(hb) and cache.is_cached(ha)
    assert cache.stats.num_evictions == 1 and cache.stats.num_snapshots_dropped == 1
    cache.check_invariants()


def test_stale_match_and_exhausted_attach_are_refused():
    bm = BlockManager(2, BS)
    cache = PrefixCache(bm)
    a, _ = run_prompt(cache, 1, list(range(4)))
    bm.free(a)
    match = cache.match(list(range(5)))
    assert match.num_tokens == 4
    bm.allocate(SequenceState(2), 8)  # evicts the cached block
    with pytest.raises(ValueError, match="stale prefix match"):
        cache.attach(SequenceState(3), match)
    cache.check_invariants()
    bm2 = BlockManager(2, BS)
    cache2 = PrefixCache(bm2)
    a2, _ = run_prompt(cache2, 1, list(range(4)))
    bm2.free(a2)
    match2 = cache2.match(list(range(5)))
    bm2.set_cap(0)
    assert not cache2.can_attach(match2)
    with pytest.raises(KVCacheExhausted):
        cache2.attach(SequenceState(3), match2)
    cache2.check_invariants()


def test_snapshot_api():
    cache = PrefixCache(BlockManager(4, BS))
    seq, _ = run_prompt(cache, 1, list(range(5)), snapshot_every_block=False)
    h = cache.boundary_hash(list(range(5)), 4)
    assert cache.snapshot_at(h) is None
    assert cache.put_snapshot(h, "s") is True
    assert cache.put_snapshot(h, "t") is False  # keeps the first
    assert cache.put_snapshot(12345, "u") is False  # key not cached
    assert cache.snapshot_at(h) == "s"
    assert cache.drop_snapshot(h) == "s" and cache.snapshot_at(h) is None
    with pytest.raises(ValueError, match="multiple of block size"):
        cache.boundary_hash(list(range(5)), 3)
    with pytest.raises(ValueError, match="cannot publish"):
        cache.register(seq, list(range(5)), 8)


def test_one_cache_per_manager():
    bm = BlockManager(4, BS)
    PrefixCache(bm)
    with pytest.raises(ValueError, match="eviction hook"):
        PrefixCache(bm)


class PrefixMachine(RuleBasedStateMachine):
    """Random request streams over a few shared prefixes under block pressure."""

    PREFIXES = [list(range(100, 112)), list(range(200, 208)), list(range(100, 108)) + [7, 7, 7, 7]]

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, BS)
        self.cache = PrefixCache(self.bm)
        self.live: dict[int, tuple[SequenceState, list[int]]] = {}
        self.next_id = 0
        self.cache.add_evict_listener(self._on_evict)

    def _on_evict(self, block_hash, handle):
        in_use = {b for seq, _ in self.live.values() for b in seq.block_table}
        # A listener runs while the evicted block is being handed out again, so
        # it must not be in any live table.
        assert handle is None or handle == f"snap-{block_hash}"
        assert not self.cache.is_cached(block_hash)
        assert all(self.bm.ref_count(b) > 0 for b in in_use)

    @rule(which=st.integers(0, 2), tail=st.lists(st.integers(0, 50), min_size=1, max_size=9),
          snap=st.booleans())
    def admit(self, which, tail, snap):
        prompt = self.PREFIXES[which] + tail
        seq = SequenceState(self.next_id)
        self.next_id += 1
        match = self.cache.match(prompt)
        assert match.num_tokens < len(prompt) and match.num_tokens % BS == 0
        for b, h in zip(match.block_ids, match.block_hashes):
            assert self.cache.is_cached(h)
        if not self.cache.can_attach(match):
            return
        in_use_before = {b: self.bm.ref_count(b) for b in range(self.bm.num_blocks)}
        self.cache.attach(seq, match)
        if not self.bm.can_allocate(seq, len(prompt) - seq.num_cached_tokens):
            self.bm.free(seq)
            return
        self.bm.allocate(seq, len(prompt) - seq.num_cached_tokens)
        # Eviction never handed out a block another live sequence holds.
        for b in seq.block_table[match.num_blocks:]:
            assert in_use_before[b] == 0 and self.bm.ref_count(b) == 1
        seq.num_cached_tokens = len(prompt)
        for h in self.cache.register(seq, prompt, len(prompt)):
            if snap:
                self.cache.put_snapshot(h, f"snap-{h}")
        self.live[seq.request_id] = (seq, prompt)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        seq, _ = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.bm.free(seq)

    @rule(cap=st.one_of(st.none(), st.integers(2, 10)))
    def set_cap(self, cap):
        self.bm.set_cap(cap)

    @invariant()
    def reference_counts_are_exact(self):
        self.cache.check_invariants()
        counts = [0] * self.bm.num_blocks
        for seq, _ in self.live.values():
            for b in seq.block_table:
                counts[b] += 1
        assert counts == [self.bm.ref_count(b) for b in range(self.bm.num_blocks)]

    @invariant()
    def live_cached_blocks_hold_their_tokens(self):
        for seq, prompt in self.live.values():
            for i, h in enumerate(self.cache.chain_hashes(prompt)):
                if self.cache.is_cached(h):
                    assert self.cache._by_hash[h].tokens == tuple(prompt[i * BS:(i + 1) * BS])


PrefixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase
