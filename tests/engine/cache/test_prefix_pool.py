"""The prefix cache with its snapshot bookkeeping (``PrefixPool``), on small pools without a model:
admission attaches and restores, a chunk publishes and snapshots where it is told, the snapshot cap
drops the least recently used, and every step is one event."""
from __future__ import annotations

import torch

from engine.cache.kv import BlockManager
from engine.cache.prefix_pool import (EVENT_EVICTED, EVENT_HIT, EVENT_RESTORED, EVENT_TAKEN, HOW_CHUNK_END,
                                      HOW_MIDCHUNK, PrefixPool)
from engine.cache.sequence import SequenceState
from engine.cache.ssm_pool import SSMPool

BS = 4


def make(num_blocks: int = 16, slots: int = 4, max_snapshots: int | None = None):
    events: list[tuple] = []
    blocks, ssm = BlockManager(num_blocks, BS), SSMPool(slots, 1, 2, 2, 1, 2, 2)
    pool = PrefixPool(blocks, ssm, needs_ssm_snapshot=True, events=lambda k, r, d: events.append((k, r, d)),
                      max_snapshots=max_snapshots)
    return pool, events


def prefill(pool: PrefixPool, request_id: int, prompt: list[int], *, points=(), state: float = 0.0):
    """Admit ``prompt``, 'compute' the rest in one chunk (the SSM state set to ``state``), publish it."""
    seq = SequenceState(request_id)
    seq.ssm_slot = pool.ssm.allocate()
    match = pool.admit(request_id, prompt, seq, max_prefill_tokens=64)
    pool.blocks.allocate(seq, len(prompt) - seq.num_cached_tokens)
    pool.ssm.recurrent[:, seq.ssm_slot] = state
    seq.num_cached_tokens = len(prompt)
    pool.after_chunk(request_id, prompt, seq, capture_at=None, captured=None, snapshot_points=set(points))
    return seq, match


def kinds(events):
    return [e[0] for e in events]


def test_a_second_turn_hits_the_first_turns_blocks_and_snapshot():
    pool, events = make()
    first = list(range(100, 112))                      # 3 full blocks
    seq, miss = prefill(pool, 1, first, points={12}, state=2.0)
    assert miss.num_tokens == 0 and kinds(events) == [EVENT_TAKEN]
    assert events[0][2]["how"] == HOW_CHUNK_END and events[0][2]["position"] == 12
    pool.blocks.free(seq)
    pool.ssm.free(seq.ssm_slot)
    events.clear()
    second = SequenceState(2)
    second.ssm_slot = pool.ssm.allocate()
    hit = pool.admit(2, first + [7, 8, 9], second, max_prefill_tokens=64)
    assert hit.num_tokens == 12 and second.num_cached_tokens == 12 and len(second.block_table) == 3
    assert torch.all(pool.ssm.recurrent[:, second.ssm_slot] == 2.0)   # the state where the match stops
    assert kinds(events) == [EVENT_HIT, EVENT_RESTORED]
    assert events[1][2]["from_request_id"] == 1 and events[1][2]["position"] == 12
    pool.cache.check_invariants()


def test_no_snapshot_outside_the_named_points_and_a_midchunk_capture_is_stored():
    pool, events = make()
    prefill(pool, 1, list(range(16)), points=())
    assert events == [] and pool.num_snapshots == 0
    seq = SequenceState(2)
    seq.ssm_slot = pool.ssm.allocate()
    prompt = list(range(50, 70))
    pool.admit(2, prompt, seq, max_prefill_tokens=64)
    pool.blocks.allocate(seq, len(prompt))
    seq.num_cached_tokens = len(prompt)
    captured = pool.ssm.snapshot(seq.ssm_slot)
    pool.after_chunk(2, prompt, seq, capture_at=16, captured=captured, snapshot_points={16})
    assert kinds(events) == [EVENT_TAKEN] and events[0][2]["how"] == HOW_MIDCHUNK


def test_the_snapshot_cap_drops_the_least_recently_used():
    pool, events = make(max_snapshots=2)
    for i in range(3):
        prefill(pool, i, [10 * i + j for j in range(8)], points={8})
    assert pool.num_snapshots == 2
    evicted = [e for e in events if e[0] == EVENT_EVICTED]
    assert len(evicted) == 1 and evicted[0][1] == 0 and evicted[0][2]["cause"] == "snapshot_cap"


def test_a_prefix_that_cannot_be_revived_beside_the_first_chunk_is_a_miss_with_a_reason():
    pool, events = make(num_blocks=4)
    seq, _ = prefill(pool, 1, list(range(12)), points={12})   # 3 blocks, then cached and evictable
    pool.blocks.free(seq)
    pool.ssm.free(seq.ssm_slot)
    other = SequenceState(9)
    other.ssm_slot = pool.ssm.allocate()
    pool.blocks.allocate(other, 4)                              # the one free block is taken
    late = SequenceState(2)
    late.ssm_slot = pool.ssm.allocate()
    match = pool.admit(2, list(range(12)) + list(range(40, 60)), late, max_prefill_tokens=64)
    assert match.num_tokens == 0 and "could not be revived" in match.miss_reason
