"""The prefix cache in the live engine: match at admission, publish after each prefill chunk.

At admission a request's prompt is matched against the cache; the matched KV
blocks are attached to its sequence, the SSM snapshot at the match point is
restored into its slot, and prefill starts there. The request row records the
hit and, when the hit is shorter than the prompt allows, why
(``prefix_miss_reason``; e.g. KV matched but no SSM snapshot exists at that
point, the reason a hybrid prefix cache otherwise sits at 0% silently).

After each prefill chunk the sequence's computed full blocks are published,
and an SSM snapshot is stored at the snapshot points the levers allow:

* the prompt's tail boundary (its last full block strictly inside the prompt)
  with ``ssm_tail_ckpt`` on: either where the planner cut the chunk, or, with
  ``ssm_tail_midchunk`` on, captured inside the chunk by the runner;
* the end of the prompt when it is block-aligned (always: the state is there).

Evicting a cached block drops its snapshot; every step is a ``GenericEvent``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.cache.prefix import PrefixCache, PrefixMatch
from engine.cache.ssm_pool import SSMSnapshot
from engine.scheduler import siblings
from engine.scheduler.chunk_plan import ChunkPlan, ssm_tail_boundary
from engine.scheduler.request import Request
from telemetry import events as ev

if TYPE_CHECKING:
    from engine.scheduler.loop import Scheduler

EVENT_HIT = "prefix_hit"
EVENT_SSM_CUT = "prefix_ssm_cut"  # KV matched further than any SSM snapshot
EVENT_RESTORED = "snapshot_restored"
EVENT_TAKEN = "snapshot_taken"
EVENT_EVICTED = "snapshot_evicted"

HOW_CHUNK_END = "chunk_end"  # a chunk ended exactly on the snapshot point
HOW_MIDCHUNK = "midchunk"  # captured inside a chunk (ssm_tail_midchunk)

SNAPSHOTS_PER_SLOT = 4  # default cap on stored snapshots: each is a whole SSM slot's worth of memory


class PrefixStep:
    """One scheduler's prefix cache, with the snapshot bookkeeping and telemetry around it."""

    def __init__(self, sched: Scheduler, max_snapshots: int | None = None) -> None:
        self.sched = sched
        runner = sched.runner
        # A snapshot costs as much memory as a live sequence's SSM state (tens of MB on a real
        # model), so only this many are kept; the least recently stored or restored goes first.
        self.max_snapshots = max_snapshots or SNAPSHOTS_PER_SLOT * runner.ssm_pool.num_slots
        self.block_size = runner.kv_block_size
        self.cache = PrefixCache(runner.block_manager,
                                 needs_ssm_snapshot=bool(runner.config.linear_attention_layers))
        self.cache.add_evict_listener(self._on_evict)
        # Who took each stored snapshot and where: block hash -> (request id, token position),
        # least recently used first.
        self._snapshot_origin: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._dropping_for_cap = False

    # ---- admission ----------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        """Attach the cached prefix to ``req`` (its slot is fresh) and start prefill after it."""
        match = self.cache.match(req.prompt_tokens)
        if match.num_tokens and req.features.prompt_logprobs is not None:
            match = _no_hit(match, "prompt logprobs asked for: every prompt position is computed")
        if match.num_tokens and not self._fits(match, req):
            match = _no_hit(match, f"KV cache full: the cached prefix of {match.num_tokens} tokens could not "
                                   f"be revived alongside the first chunk")
        self.cache.attach(req.seq, match)
        if match.snapshot is not None:
            self.sched.runner.ssm_pool.restore(match.snapshot, req.seq.ssm_slot)
        req.chunk_offset = match.num_tokens
        req.prefix_hit_tokens = match.num_tokens
        req.prefix_miss_reason = match.miss_reason
        if match.num_tokens:
            self._event(EVENT_HIT, req.request_id, num_tokens=match.num_tokens,
                        num_kv_tokens=match.num_kv_tokens, prompt_len=req.prompt_len,
                        num_blocks=match.num_blocks)
        if match.num_tokens < match.num_kv_tokens:
            self._event(EVENT_SSM_CUT, req.request_id, num_tokens=match.num_tokens,
                        num_kv_tokens=match.num_kv_tokens, reason=match.miss_reason)
        if match.snapshot is not None:
            if match.block_hashes[-1] in self._snapshot_origin:
                self._snapshot_origin.move_to_end(match.block_hashes[-1])
            origin = self._snapshot_origin.get(match.block_hashes[-1], (None, None))
            self._event(EVENT_RESTORED, req.request_id, position=match.num_tokens,
                        block_hash=_hex(match.block_hashes[-1]), from_request_id=origin[0])

    def _fits(self, match: PrefixMatch, req: Request) -> bool:
        """Reviving the evictable matched blocks and the first chunk's new blocks fit together
        (the loop checked room for a chunk from token 0; a revived block takes room too)."""
        bm = self.sched.runner.block_manager
        num_revived = sum(1 for b in match.block_ids if bm.ref_count(b) == 0)
        first_chunk = min(req.prompt_len - match.num_tokens, self.sched.levers.max_prefill_tokens)
        num_new = bm.num_blocks_for(match.num_tokens + first_chunk) - match.num_blocks
        return num_revived + num_new <= bm.num_free

    # ---- after a prefill chunk ----------------------------------------------------------------
    def after_chunk(self, req: Request, chunk: ChunkPlan) -> None:
        """Publish the chunk's full blocks and store the snapshots this chunk reached."""
        end = req.chunk_offset  # == req.seq.num_cached_tokens
        start = end - chunk.length
        self.cache.register(req.seq, req.prompt_tokens, end)
        runner = self.sched.runner
        capture_at = capture_point(self.sched, req, start, chunk.length)
        if capture_at is not None and runner.last_capture is not None:
            self._store(req, capture_at, runner.last_capture, HOW_MIDCHUNK)
        if end % self.block_size == 0 and end in snapshot_points(self.sched, req):
            if self._wants_snapshot(req, end):
                self._store(req, end, runner.ssm_pool.snapshot(req.seq.ssm_slot), HOW_CHUNK_END)

    def _wants_snapshot(self, req: Request, position: int) -> bool:
        block_hash = self.cache.boundary_hash(req.prompt_tokens, position)
        return self.cache.is_cached(block_hash) and self.cache.snapshot_at(block_hash) is None

    def _store(self, req: Request, position: int, snapshot: SSMSnapshot, how: str) -> None:
        block_hash = self.cache.boundary_hash(req.prompt_tokens, position)
        if not self.cache.put_snapshot(block_hash, snapshot):
            return  # not cached (nothing to key it by) or another request stored one first
        self._snapshot_origin[block_hash] = (req.request_id, position)
        self._event(EVENT_TAKEN, req.request_id, position=position, how=how, block_hash=_hex(block_hash))
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
        sched = self.sched
        sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=kind,
                                   request_id=request_id, detail=detail))

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshot_origin)


# ---- pure decisions -------------------------------------------------------------------------
def snapshot_points(sched: Scheduler, req: Request) -> set[int]:
    """Prompt positions where an SSM snapshot is stored under the current levers."""
    block_size = sched.runner.kv_block_size
    points = set()
    if siblings.tail_ckpt(sched, req):
        tail = ssm_tail_boundary(req.prompt_len, block_size)
        if tail is not None:
            points.add(tail)
    if req.prompt_len % block_size == 0:
        points.add(req.prompt_len)
    return points


def capture_point(sched: Scheduler, req: Request, offset: int, length: int) -> int | None:
    """The tail boundary when it lies strictly inside this chunk and mid-chunk capture is on."""
    if sched.prefix is None or not (siblings.tail_ckpt(sched, req) and sched.levers.ssm_tail_midchunk):
        return None
    if not sched.runner.config.linear_attention_layers:
        return None
    tail = ssm_tail_boundary(req.prompt_len, sched.runner.kv_block_size)
    return tail if tail is not None and offset < tail < offset + length else None


def _no_hit(match: PrefixMatch, reason: str) -> PrefixMatch:
    """An empty match that says why the cached prefix is not used."""
    return PrefixMatch(num_tokens=0, block_ids=(), block_hashes=(), num_prompt_tokens=match.num_prompt_tokens,
                       num_kv_tokens=match.num_kv_tokens, snapshot=None, miss_reason=reason)


def _hex(block_hash: int) -> str:
    """Block keys are unsigned 64-bit: as text they survive JSON and SQLite unchanged."""
    return f"{block_hash:016x}"


# ---- hooks the scheduler calls (no-ops with the prefix cache off) ------------------------
def on_admit(sched: Scheduler, req: Request) -> None:
    if sched.prefix is not None:
        sched.prefix.admit(req)


def on_chunk_done(sched: Scheduler, req: Request, chunk: ChunkPlan) -> None:
    if sched.prefix is not None:
        sched.prefix.after_chunk(req, chunk)
