"""Paged KV block manager: block tables, a free list and reference counts.

Pure bookkeeping, no tensors: the model runner owns the K/V storage and
indexes it with the block ids handed out here.

Every physical block is in exactly one of three states:

* free: holds nothing, sits in the free list;
* in use: reference count > 0, listed in that many block tables (more than
  one only when the prefix cache shares it);
* evictable: reference count 0 but its contents are kept because the prefix
  cache may hand it out again; reclaimed least recently used when an
  allocation finds the free list empty, and then ``on_evict`` is called so
  the prefix cache can forget it.

Free and evictable blocks both count as ``num_free``: an allocation may take
either. A runtime cap (``set_cap``) limits how many blocks may be in use at
once without touching blocks already handed out.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

from engine.cache.sequence import SequenceState


class KVCacheExhausted(RuntimeError):
    """Not enough usable blocks for an allocation; the manager is unchanged."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._cap: int | None = None
        self._ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        # Blocks kept for the prefix cache once unreferenced; oldest use first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._retained: set[int] = set()
        self._num_used = 0
        # Sequences holding blocks, by request id; lets check_invariants
        # recount every reference from the block tables themselves.
        self._owners: dict[int, SequenceState] = {}
        self.on_evict: Callable[[int], None] | None = None
        self.num_evictions = 0

    # ---- capacity -----------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks if self._cap is None else min(self.num_blocks, self._cap)

    @property
    def cap(self) -> int | None:
        return self._cap

    def set_cap(self, cap: int | None) -> None:
        """Limit blocks in use to ``cap`` (None lifts it). Frees nothing:
        when usage is above the new cap, allocations wait until it drops."""
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"KV block cap must be a non-negative int or None, got {cap!r}")
        self._cap = cap

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_free(self) -> int:
        # Clamped: after the cap is lowered below usage nothing is free.
        return max(0, self.num_usable - self._num_used)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: SequenceState, num_new_tokens: int) -> int:
        """Blocks ``allocate(seq, num_new_tokens)`` would add to the table."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        wanted = self.num_blocks_for(seq.num_cached_tokens + num_new_tokens)
        return max(0, wanted - len(seq.block_table))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---- allocation ---------------------------------------------------
    def can_allocate(self, seq: SequenceState, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: SequenceState, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_cached_tokens + num_new_tokens``
        tokens. All or nothing: raises KVCacheExhausted and changes nothing."""
        num_needed = self.num_new_blocks(seq, num_new_tokens)
        if num_needed == 0:
            return
        self._claim_owner(seq)
        if num_needed > self.num_free:
            raise KVCacheExhausted(
                f"KV cache exhausted: need {num_needed} more blocks, "
                f"{self.num_free} free of {self.num_usable} usable"
            )
        for _ in range(num_needed):
            block_id = self._take_block()
            self._ref_counts[block_id] = 1
            self._num_used += 1
            seq.block_table.append(block_id)
        self._owners[seq.request_id] = seq

    def free(self, seq: SequenceState) -> int:
        """Drop every reference ``seq`` holds, clear its table and reset
        ``num_cached_tokens``; returns how many blocks became allocatable
        (shared blocks still referenced elsewhere are not counted)."""
        owner = self._owners.get(seq.request_id)
        if seq.block_table and owner is not seq:
            raise ValueError(f"request {seq.request_id} holds blocks this manager did not hand out")
        num_released = 0
        # Reverse order: the deepest blocks of a chain become evictable first,
        # so LRU eviction takes a prefix's tail before its head.
        for block_id in reversed(seq.block_table):
            if self.decref(block_id):
                num_released += 1
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        self._owners.pop(seq.request_id, None)
        return num_released

    # ---- sharing (used by the prefix cache) ---------------------------
    def retain(self, block_id: int) -> None:
        """Keep ``block_id``'s contents when its last reference goes."""
        self._retained.add(block_id)

    def forget(self, block_id: int) -> None:
        """Stop keeping ``block_id``'s contents; an evictable block goes free."""
        self._retained.discard(block_id)
        if block_id in self._evictable:
            del self._evictable[block_id]
            self._free_ids.append(block_id)
            self._contents_dropped(block_id, was_evictable=True)

    def is_retained(self, block_id: int) -> bool:
        return block_id in self._retained

    def can_share(self, block_ids: list[int]) -> bool:
        """Whether increfing these blocks fits under the usable count
        (reviving an evictable block puts it back in use)."""
        num_revived = sum(1 for b in set(block_ids) if self._ref_counts[b] == 0)
        return num_revived <= self.num_free

    def share(self, seq: SequenceState, block_ids: list[int]) -> None:
        """Append already-filled blocks to an empty ``seq`` table, one
        reference each. All or nothing like ``allocate``."""
        if seq.block_table:
            raise ValueError(f"request {seq.request_id}: shared blocks must start an empty block table")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"request {seq.request_id}: a block id repeats in {block_ids}")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0 and block_id not in self._evictable:
                raise ValueError(f"block {block_id} holds no cached contents to share")
        self._claim_owner(seq)
        if not self.can_share(block_ids):
            num_revived = sum(1 for b in block_ids if self._ref_counts[b] == 0)
            raise KVCacheExhausted(
                f"KV cache exhausted: need {num_revived} more blocks, "
                f"{self.num_free} free of {self.num_usable} usable"
            )
        for block_id in block_ids:
            self.incref(block_id)
            seq.block_table.append(block_id)
        if block_ids:
            self._owners[seq.request_id] = seq

    def incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            if block_id not in self._evictable:
                raise ValueError(f"block {block_id} is free; allocate it instead of increfing")
            del self._evictable[block_id]
            self._num_used += 1
            self._revived(block_id)
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int) -> bool:
        """Drop one reference; True when it was the last one."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} has no reference to drop")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return False
        self._num_used -= 1
        if block_id in self._retained:
            self._evictable[block_id] = None  # newest at the end
            self._became_evictable(block_id)
        else:
            self._free_ids.append(block_id)
            self._contents_dropped(block_id, was_evictable=False)
        return True

    def touch(self, block_id: int) -> None:
        """Mark an evictable block as just used (moves it to the LRU end)."""
        if block_id in self._evictable:
            self._evictable.move_to_end(block_id)

    def _take_block(self) -> int:
        if self._free_ids:
            return self._free_ids.popleft()
        # Callers checked num_free, and free + evictable >= num_blocks - used
        # >= num_usable - used, so an evictable block exists here.
        return self._evict_lru()

    def _evict_lru(self) -> int:
        """Reclaim the least recently used evictable block; returns its id (not in the free list)."""
        block_id, _ = self._evictable.popitem(last=False)
        self._retained.discard(block_id)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block_id)
        self._contents_dropped(block_id, was_evictable=True)
        return block_id

    # ---- hooks for a manager that also accounts bytes (engine/cache/kv_budget.py) -------------
    def _contents_dropped(self, block_id: int, *, was_evictable: bool) -> None:
        """``block_id`` no longer holds contents (gone to the free list, or evicted for reuse)."""

    def _became_evictable(self, block_id: int) -> None:
        """``block_id`` lost its last reference but keeps its contents for the prefix cache."""

    def _revived(self, block_id: int) -> None:
        """An evictable ``block_id`` is in use again."""

    def _claim_owner(self, seq: SequenceState) -> None:
        owner = self._owners.get(seq.request_id)
        if owner is not None and owner is not seq and not owner.block_table:
            # The old state gave all its blocks back (an undone allocation):
            # the request id is free to take.
            del self._owners[seq.request_id]
        elif owner is not None and owner is not seq:
            raise ValueError(f"request id {seq.request_id} already owns blocks through another SequenceState")

    # ---- checks -------------------------------------------------------
    def check_invariants(self) -> None:
        counted = [0] * self.num_blocks
        for request_id, seq in self._owners.items():
            assert seq.request_id == request_id, f"owner key {request_id} != seq {seq.request_id}"
            assert len(set(seq.block_table)) == len(seq.block_table), (
                f"request {request_id} lists a block twice: {seq.block_table}")
            assert seq.num_cached_tokens <= len(seq.block_table) * self.block_size, (
                f"request {request_id}: {seq.num_cached_tokens} cached tokens exceed "
                f"{len(seq.block_table)} blocks")
            for block_id in seq.block_table:
                counted[block_id] += 1
        assert counted == self._ref_counts, "reference counts differ from block tables"
        free_ids = set(self._free_ids)
        assert len(free_ids) == len(self._free_ids), "a block is in the free list twice"
        evictable = set(self._evictable)
        in_use = {b for b, n in enumerate(self._ref_counts) if n > 0}
        assert not free_ids & evictable, f"blocks both free and evictable: {free_ids & evictable}"
        assert not free_ids & in_use, f"blocks both free and in use: {free_ids & in_use}"
        assert not evictable & in_use, f"blocks both evictable and in use: {evictable & in_use}"
        assert len(free_ids) + len(evictable) + len(in_use) == self.num_blocks, "a block is lost"
        assert evictable <= self._retained, "an evictable block is not retained"
        assert self._num_used == len(in_use), f"num_used {self._num_used} != {len(in_use)} in use"
        self._check_capacity()

    def _check_capacity(self) -> None:
        assert self.num_used + self.num_free == max(self.num_usable, self.num_used)
