"""The prefix cache of a running engine: match and attach at admission, publish after each chunk, and
the SSM snapshots it stores (a bounded, least-recently-used set), every step reported as an event.

At admission a request's prompt is matched; the matched KV blocks are attached to its sequence
and the SSM snapshot at the match point is restored into its slot, so prefill starts there
(``PrefixMatch.miss_reason`` says why a hit is shorter than the prompt allows, e.g. KV matched
but no SSM snapshot exists at that point: the reason a hybrid prefix cache otherwise sits at 0%
silently). After each prefill chunk the sequence's computed full blocks are published, and an
SSM snapshot is stored at the points the scheduler names (``prefix_step.snapshot_points``).
Evicting a cached block drops its snapshot. Plain values in; the events go to ``events(kind,
request_id, detail)``, which stamps them with the tick.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from engine.cache.kv import BlockManager
from engine.cache.prefix import PrefixCache, PrefixMatch
from engine.cache.sequence import SequenceState
from engine.cache.ssm_pool import SSMPool, SSMSnapshot

EVENT_HIT = "prefix_hit"
EVENT_SSM_CUT = "prefix_ssm_cut"  # KV matched further than any SSM snapshot
EVENT_RESTORED = "snapshot_restored"
EVENT_TAKEN = "snapshot_taken"
EVENT_EVICTED = "snapshot_evicted"

HOW_CHUNK_END = "chunk_end"  # a chunk ended exactly on the snapshot point
HOW_MIDCHUNK = "midchunk"  # captured inside a chunk (ssm_tail_midchunk)

SNAPSHOTS_PER_SLOT = 4  # default cap on stored snapshots: each is a whole SSM slot's worth of memory

Events = Callable[[str, "int | None", dict], None]


class PrefixPool:
    """One engine's prefix cache, with the snapshot bookkeeping and the events around it."""

    def __init__(self, blocks: BlockManager, ssm: SSMPool, *, needs_ssm_snapshot: bool, events: Events,
                 max_snapshots: int | None = None) -> None:
        self.blocks, self.ssm, self._events = blocks, ssm, events
        # A snapshot costs as much memory as a live sequence's SSM state (tens of MB on a real
        # model), so only this many are kept; the least recently stored or restored goes first.
        self.max_snapshots = max_snapshots or SNAPSHOTS_PER_SLOT * ssm.num_slots
        self.block_size = blocks.block_size
        self.cache = PrefixCache(blocks, needs_ssm_snapshot=needs_ssm_snapshot)
        self.cache.add_evict_listener(self._on_evict)
        # Who took each stored snapshot and where: block hash -> (request id, token position),
        # least recently used first.
        self._snapshot_origin: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._dropping_for_cap = False

    # ---- admission ----------------------------------------------------------------------
    def admit(self, request_id: int, prompt: Sequence[int], seq: SequenceState, max_prefill_tokens: int,
              no_hit: str | None = None) -> PrefixMatch:
        """Attach the cached prefix of ``prompt`` to ``seq`` (its slot is fresh); prefill starts at
        the match's ``num_tokens``. ``no_hit``: why this request takes no hit (its miss reason)."""
        match = self.cache.match(prompt)
        if match.num_tokens and no_hit is not None:
            match = _no_hit(match, no_hit)
        if match.num_tokens and not self._fits(match, len(prompt), max_prefill_tokens):
            match = _no_hit(match, f"KV cache full: the cached prefix of {match.num_tokens} tokens could not "
                                   f"be revived alongside the first chunk")
        self.cache.attach(seq, match)
        if match.snapshot is not None:
            self.ssm.restore(match.snapshot, seq.ssm_slot)
        if match.num_tokens:
            self._event(EVENT_HIT, request_id, num_tokens=match.num_tokens, num_kv_tokens=match.num_kv_tokens,
                        prompt_len=len(prompt), num_blocks=match.num_blocks)
        if match.num_tokens < match.num_kv_tokens:
            self._event(EVENT_SSM_CUT, request_id, num_tokens=match.num_tokens,
                        num_kv_tokens=match.num_kv_tokens, reason=match.miss_reason)
        if match.snapshot is not None:
            if match.block_hashes[-1] in self._snapshot_origin:
                self._snapshot_origin.move_to_end(match.block_hashes[-1])
            origin = self._snapshot_origin.get(match.block_hashes[-1], (None, None))
            self._event(EVENT_RESTORED, request_id, position=match.num_tokens,
                        block_hash=_hex(match.block_hashes[-1]), from_request_id=origin[0])
        return match

    def _fits(self, match: PrefixMatch, prompt_len: int, max_prefill_tokens: int) -> bool:
        """Reviving the evictable matched blocks and the first chunk's new blocks fit together
        (admission checked room for a chunk from token 0; a revived block takes room too)."""
        bm = self.blocks
        num_revived = sum(1 for b in match.block_ids if bm.ref_count(b) == 0)
        first_chunk = min(prompt_len - match.num_tokens, max_prefill_tokens)
        num_new = bm.num_blocks_for(match.num_tokens + first_chunk) - match.num_blocks
        return num_revived + num_new <= bm.num_free

    # ---- after a prefill chunk ----------------------------------------------------------------
    def after_chunk(self, request_id: int, prompt: Sequence[int], seq: SequenceState, *, capture_at: int | None,
                    captured: SSMSnapshot | None, snapshot_points: Collection[int]) -> None:
        """Publish the full blocks computed so far (``seq.num_cached_tokens``) and store the snapshots
        this chunk reached: ``captured`` inside it at ``capture_at``, the slot's state at its end."""
        end = seq.num_cached_tokens
        self.cache.register(seq, prompt, end)
        if capture_at is not None and captured is not None:
            self._store(request_id, prompt, capture_at, captured, HOW_MIDCHUNK)
        if end % self.block_size == 0 and end in snapshot_points and self._wants_snapshot(prompt, end):
            self._store(request_id, prompt, end, self.ssm.snapshot(seq.ssm_slot), HOW_CHUNK_END)

    def _wants_snapshot(self, prompt: Sequence[int], position: int) -> bool:
        block_hash = self.cache.boundary_hash(prompt, position)
        return self.cache.is_cached(block_hash) and self.cache.snapshot_at(block_hash) is None

    def _store(self, request_id: int, prompt: Sequence[int], position: int, snapshot: SSMSnapshot, how: str) -> None:
        block_hash = self.cache.boundary_hash(prompt, position)
        if not self.cache.put_snapshot(block_hash, snapshot):
            return  # not cached (nothing to key it by) or another request stored one first
        self._snapshot_origin[block_hash] = (request_id, position)
        self._event(EVENT_TAKEN, request_id, position=position, how=how, block_hash=_hex(block_hash))
        while len(self._snapshot_origin) > self.max_snapshots:
            oldest = next(iter(self._snapshot_origin))
            self._dropping_for_cap = True
            try:
                if self.cache.drop_snapshot(oldest) is None:  # the listener below forgets and logs it
                    self._snapshot_origin.pop(oldest, None)
            finally:
                self._dropping_for_cap = False

    # ---- eviction ----------------------------------------------------------------------------
    def _on_evict(self, block_hash: int, handle: object | None) -> None:
        """A cached block was evicted (or its snapshot dropped): forget the handle, log it."""
        origin = self._snapshot_origin.pop(block_hash, None)
        if handle is None:
            return
        request_id, position = origin if origin is not None else (None, None)
        self._event(EVENT_EVICTED, request_id, position=position, block_hash=_hex(block_hash),
                    cause="snapshot_cap" if self._dropping_for_cap else "block_evicted")

    def _event(self, kind: str, request_id: int | None, **detail) -> None:
        self._events(kind, request_id, detail)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshot_origin)


def _no_hit(match: PrefixMatch, reason: str) -> PrefixMatch:
    """An empty match that says why the cached prefix is not used."""
    return PrefixMatch(num_tokens=0, block_ids=(), block_hashes=(), num_prompt_tokens=match.num_prompt_tokens,
                       num_kv_tokens=match.num_kv_tokens, snapshot=None, miss_reason=reason)


def _hex(block_hash: int) -> str:
    """Block keys are unsigned 64-bit: as text they survive JSON and SQLite unchanged."""
    return f"{block_hash:016x}"
