"""Prefix cache: full KV blocks keyed by a chain hash of their tokens.

A block's key hashes its parent's key together with its own tokens, so one
key names a whole prefix. Matching walks a prompt block by block and stops at
the first key not cached. Matched blocks are shared by reference count
through the block manager; when the last sequence lets go of a cached block
it stays evictable and is reclaimed least recently used (see
``engine.cache.kv``), which drops its key here and its SSM snapshot.

Hybrid models also need the linear-attention (SSM) state where the match
stops: KV alone cannot resume a Gated DeltaNet layer. The SSM pool owns the
snapshot tensors; this module keeps one opaque handle per block-boundary key,
cuts a match back to the deepest boundary that has one, and says why
(``PrefixMatch.miss_reason``), so a hybrid prefix cache never sits at 0%
silently.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from engine.cache.kv import BlockManager
from engine.cache.sequence import SequenceState

ROOT_HASH = 0


def chain_hash(parent_hash: int, block_tokens: Sequence[int]) -> int:
    """64-bit key of a block given its parent's key (ROOT_HASH for the first)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little"))
    digest.update(array("q", block_tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass(frozen=True)
class PrefixMatch:
    """The cached prefix of one prompt, ready for ``PrefixCache.attach``."""

    num_tokens: int  # tokens whose KV (and SSM state, if needed) is reused
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_prompt_tokens: int
    num_kv_tokens: int  # KV-only match before the SSM snapshot cut
    snapshot: object | None = None  # SSM handle at num_tokens (None at 0 or if not needed)
    miss_reason: str | None = None  # why the match is shorter than the matchable prefix

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class PrefixStats:
    num_lookups: int = 0  # attach calls, one per admitted request
    num_hits: int = 0  # lookups that reused at least one block
    num_hit_tokens: int = 0
    num_prompt_tokens: int = 0
    num_ssm_cuts: int = 0  # lookups shortened for lack of an SSM snapshot
    num_evictions: int = 0
    num_snapshots_stored: int = 0
    num_snapshots_dropped: int = 0

    @property
    def hit_token_ratio(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


EvictListener = Callable[[int, object | None], None]  # (block hash, snapshot handle or None)


@dataclass
class _CachedBlock:
    block_id: int
    tokens: tuple[int, ...]  # compared on match, so a hash collision cannot alias
    snapshot: object | None = None


class PrefixCache:
    def __init__(self, block_manager: BlockManager, *, needs_ssm_snapshot: bool = True):
        if block_manager.on_evict is not None:
            raise ValueError("block manager already has an eviction hook; one prefix cache per manager")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.needs_ssm_snapshot = needs_ssm_snapshot
        self.stats = PrefixStats()
        self._by_hash: dict[int, _CachedBlock] = {}
        self._hash_by_block: dict[int, int] = {}
        self._evict_listeners: list[EvictListener] = []
        block_manager.on_evict = self._on_block_evicted

    def add_evict_listener(self, listener: EvictListener) -> None:
        """Called with (block hash, snapshot handle or None) when a cached
        block is evicted or a snapshot is dropped; the owner frees the handle."""
        self._evict_listeners.append(listener)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def chain_hashes(self, tokens: Sequence[int], num_blocks: int | None = None) -> list[int]:
        """Keys of the first ``num_blocks`` full blocks of ``tokens``."""
        num_full = len(tokens) // self.block_size
        num_blocks = num_full if num_blocks is None else num_blocks
        if num_blocks > num_full:
            raise ValueError(f"{num_blocks} full blocks asked of {len(tokens)} tokens (block size {self.block_size})")
        hashes, parent = [], ROOT_HASH
        for i in range(num_blocks):
            parent = chain_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def boundary_hash(self, tokens: Sequence[int], num_tokens: int) -> int:
        """Key of the block that ends at ``num_tokens`` (a block multiple > 0):
        the key an SSM snapshot taken there is stored under."""
        if num_tokens <= 0 or num_tokens % self.block_size:
            raise ValueError(f"snapshot boundary {num_tokens} is not a positive multiple of block size {self.block_size}")
        return self.chain_hashes(tokens, num_tokens // self.block_size)[-1]

    # ---- lookup -------------------------------------------------------
    def match(self, prompt_tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached full-block prefix, leaving at least one prompt
        token to compute (its logits give the first output token). Pure."""
        bs = self.block_size
        num_matchable = (len(prompt_tokens) - 1) // bs if prompt_tokens else 0
        hashes: list[int] = []
        parent = ROOT_HASH
        for i in range(num_matchable):
            block_tokens = tuple(prompt_tokens[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, block_tokens)
            cached = self._by_hash.get(parent)
            if cached is None or cached.tokens != block_tokens:
                break
            hashes.append(parent)
        num_kv = len(hashes)
        num_kept, snapshot = num_kv, None
        if self.needs_ssm_snapshot:
            while num_kept > 0 and self._by_hash[hashes[num_kept - 1]].snapshot is None:
                num_kept -= 1
            if num_kept:
                snapshot = self._by_hash[hashes[num_kept - 1]].snapshot
        reason = self._miss_reason(len(prompt_tokens), num_matchable, num_kv, num_kept)
        return PrefixMatch(
            num_tokens=num_kept * bs,
            block_ids=tuple(self._by_hash[h].block_id for h in hashes[:num_kept]),
            block_hashes=tuple(hashes[:num_kept]),
            num_prompt_tokens=len(prompt_tokens),
            num_kv_tokens=num_kv * bs,
            snapshot=snapshot,
            miss_reason=reason,
        )

    def _miss_reason(self, num_prompt: int, num_matchable: int, num_kv: int, num_kept: int) -> str | None:
        bs = self.block_size
        if num_matchable == 0:
            return f"prompt of {num_prompt} tokens has no full block before its last token (block size {bs})"
        if num_kept < num_kv:
            return (f"no SSM snapshot at token {num_kv * bs} (KV matched {num_kv * bs}, "
                    f"deepest snapshot at token {num_kept * bs})")
        if num_kv < num_matchable:
            return f"no cached KV block at token {num_kv * bs} (matchable {num_matchable * bs})"
        return None

    def can_attach(self, match: PrefixMatch) -> bool:
        return self.block_manager.can_share(list(match.block_ids))

    def attach(self, seq: SequenceState, match: PrefixMatch) -> None:
        """Give an empty ``seq`` the matched blocks (one reference each) and
        set ``num_cached_tokens``; counts the lookup. Call it once per
        admission, an empty match included. Raises ValueError when the
        match went stale (a block was evicted since ``match``) and
        KVCacheExhausted when reviving evictable blocks does not fit."""
        for block_hash, block_id in zip(match.block_hashes, match.block_ids):
            cached = self._by_hash.get(block_hash)
            if cached is None or cached.block_id != block_id:
                raise ValueError(f"stale prefix match for request {seq.request_id}: block {block_id} was evicted")
        self.block_manager.share(seq, list(match.block_ids))
        seq.num_cached_tokens = match.num_tokens
        for block_id in match.block_ids:
            self.block_manager.touch(block_id)
        self.stats.num_lookups += 1
        self.stats.num_prompt_tokens += match.num_prompt_tokens
        self.stats.num_hit_tokens += match.num_tokens
        self.stats.num_hits += match.num_tokens > 0
        self.stats.num_ssm_cuts += match.num_tokens < match.num_kv_tokens

    # ---- publishing ---------------------------------------------------
    def register(self, seq: SequenceState, tokens: Sequence[int], upto_tokens: int) -> list[int]:
        """Publish ``seq``'s full blocks covering ``tokens[:upto_tokens]``
        (their KV must be computed). Returns the keys of those blocks.
        A key already cached under another block keeps that block."""
        if upto_tokens > len(tokens) or upto_tokens > seq.num_cached_tokens:
            raise ValueError(
                f"request {seq.request_id}: cannot publish {upto_tokens} tokens, "
                f"{seq.num_cached_tokens} computed of {len(tokens)} given")
        num_blocks = upto_tokens // self.block_size
        hashes = self.chain_hashes(tokens, num_blocks)
        for i, block_hash in enumerate(hashes):
            block_id = seq.block_table[i]
            if block_hash in self._by_hash or block_id in self._hash_by_block:
                continue
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            self._by_hash[block_hash] = _CachedBlock(block_id, block_tokens)
            self._hash_by_block[block_id] = block_hash
            self.block_manager.retain(block_id)
        return hashes

    # ---- SSM snapshot handles -----------------------------------------
    def snapshot_at(self, block_hash: int) -> object | None:
        cached = self._by_hash.get(block_hash)
        return None if cached is None else cached.snapshot

    def put_snapshot(self, block_hash: int, handle: object) -> bool:
        """Store ``handle`` under a cached block's key. False (the caller
        keeps and frees the handle) when the key is not cached or already
        has a snapshot."""
        if handle is None:
            raise ValueError("snapshot handle must not be None")
        cached = self._by_hash.get(block_hash)
        if cached is None or cached.snapshot is not None:
            return False
        cached.snapshot = handle
        self.stats.num_snapshots_stored += 1
        return True

    def drop_snapshot(self, block_hash: int) -> object | None:
        """Forget the snapshot under ``block_hash`` (the block stays cached);
        listeners are told, and the handle is returned."""
        cached = self._by_hash.get(block_hash)
        if cached is None or cached.snapshot is None:
            return None
        handle, cached.snapshot = cached.snapshot, None
        self.stats.num_snapshots_dropped += 1
        self._notify(block_hash, handle)
        return handle

    def _on_block_evicted(self, block_id: int) -> None:
        block_hash = self._hash_by_block.pop(block_id)
        cached = self._by_hash.pop(block_hash)
        self.stats.num_evictions += 1
        if cached.snapshot is not None:
            self.stats.num_snapshots_dropped += 1
        self._notify(block_hash, cached.snapshot)

    def _notify(self, block_hash: int, handle: object | None) -> None:
        for listener in self._evict_listeners:
            listener(block_hash, handle)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        assert len(self._by_hash) == len(self._hash_by_block), "hash maps differ in size"
        for block_hash, cached in self._by_hash.items():
            assert self._hash_by_block.get(cached.block_id) == block_hash, f"block {cached.block_id} key mismatch"
            assert self.block_manager.is_retained(cached.block_id), f"cached block {cached.block_id} not retained"
        assert self.block_manager.num_evictable <= len(self._by_hash)
