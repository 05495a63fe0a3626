"""A block manager that budgets bytes: full-precision and quantized blocks side by side.

With InnerQ a block is in one of two formats. A new block is always full precision (it
holds the newest tokens, inside the recent window); once its tokens leave the windows the
runner quantizes it (``mark_quantized``), which gives back its full-precision slot and the
difference in bytes. Evictable blocks kept for the prefix cache keep their format and their
bytes until evicted.

The budget counts every block holding contents (in use or evictable) at its format's size.
``num_free`` is counted in new (full-precision) blocks, so the scheduler's admission and
preemption rules work unchanged; an allocation evicts least recently used prefix blocks
until both a block id and the bytes are there. Block ids go up to ``budget // quant bytes``
(the most blocks the budget can hold), the full-precision pool has ``budget // fp bytes``
slots (so a calibration phase that writes only full precision can fill the budget).
Pure bookkeeping: ``on_fp_slot`` tells the store where a block's full-precision data lives.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from engine.cache.kv import BlockManager

NO_SLOT = -1


class ByteBudgetBlockManager(BlockManager):
    def __init__(self, budget_bytes: int, fp_block_bytes: int, quant_block_bytes: int, block_size: int = 16):
        if fp_block_bytes < 1 or quant_block_bytes < 1 or quant_block_bytes > fp_block_bytes:
            raise ValueError(f"need 0 < quantized block bytes <= full-precision block bytes, got "
                             f"{quant_block_bytes} and {fp_block_bytes}")
        if budget_bytes < fp_block_bytes:
            raise ValueError(f"--kv-cache-mb: a KV budget of {budget_bytes} bytes holds no full-precision block "
                             f"({fp_block_bytes} bytes)")
        super().__init__(budget_bytes // quant_block_bytes, block_size)
        self.budget_bytes = budget_bytes
        self.fp_block_bytes = fp_block_bytes
        self.quant_block_bytes = quant_block_bytes
        self.num_fp_slots = budget_bytes // fp_block_bytes
        self._fp_slot = [NO_SLOT] * self.num_blocks          # NO_SLOT: quantized (or free)
        self._free_fp_slots: deque[int] = deque(range(self.num_fp_slots))
        self._quantizable = [False] * self.num_blocks
        self._held_bytes = 0          # blocks in use or evictable
        self._evictable_bytes = 0
        self.quantize_new_blocks = False  # set once the calibration is applied
        self.on_fp_slot: Callable[[int, int], None] | None = None  # (block id, fp slot or NO_SLOT)

    # ---- what the scheduler and the gauges read -----------------------------------------------
    @property
    def num_free(self) -> int:
        reclaimable = self.budget_bytes - self._held_bytes + self._evictable_bytes
        return max(0, min(super().num_free, reclaimable // self.fp_block_bytes))

    @property
    def bytes_used(self) -> int:
        """Bytes of blocks in use (evictable prefix blocks not counted, like ``num_used``)."""
        return self._held_bytes - self._evictable_bytes

    @property
    def bytes_held(self) -> int:
        return self._held_bytes

    @property
    def num_quantized(self) -> int:
        return sum(1 for b, slot in enumerate(self._fp_slot) if slot == NO_SLOT and self._holds(b))

    def fp_slot(self, block_id: int) -> int:
        return self._fp_slot[block_id]

    def is_quantized(self, block_id: int) -> bool:
        return self._fp_slot[block_id] == NO_SLOT

    def is_quantizable(self, block_id: int) -> bool:
        """Written after the calibration was applied and still full precision."""
        return self._quantizable[block_id] and self._fp_slot[block_id] != NO_SLOT

    # ---- format change ----------------------------------------------------------------------
    def mark_quantized(self, block_id: int) -> None:
        """The store has quantized ``block_id``: release its full-precision slot and bytes."""
        if not self.is_quantizable(block_id) or self.ref_count(block_id) == 0:
            raise ValueError(f"block {block_id} is not an in-use, quantizable full-precision block")
        self._free_fp_slots.append(self._fp_slot[block_id])
        self._set_slot(block_id, NO_SLOT)
        self._held_bytes -= self.fp_block_bytes - self.quant_block_bytes

    # ---- allocation hooks ---------------------------------------------------------------------
    def _take_block(self) -> int:
        while self._held_bytes + self.fp_block_bytes > self.budget_bytes:
            # num_free promised reclaimable bytes: evicting prefix blocks gives them back.
            self._free_ids.append(self._evict_lru())
        block_id = super()._take_block()
        self._set_slot(block_id, self._free_fp_slots.popleft())
        self._quantizable[block_id] = self.quantize_new_blocks
        self._held_bytes += self.fp_block_bytes
        return block_id

    def _contents_dropped(self, block_id: int, *, was_evictable: bool) -> None:
        cost = self._cost(block_id)
        self._held_bytes -= cost
        if was_evictable:
            self._evictable_bytes -= cost
        if self._fp_slot[block_id] != NO_SLOT:
            self._free_fp_slots.append(self._fp_slot[block_id])
        self._set_slot(block_id, NO_SLOT)
        self._quantizable[block_id] = False

    def _became_evictable(self, block_id: int) -> None:
        self._evictable_bytes += self._cost(block_id)

    def _revived(self, block_id: int) -> None:
        self._evictable_bytes -= self._cost(block_id)

    # ---- helpers ----------------------------------------------------------------------------------
    def _cost(self, block_id: int) -> int:
        return self.fp_block_bytes if self._fp_slot[block_id] != NO_SLOT else self.quant_block_bytes

    def _holds(self, block_id: int) -> bool:
        return self.ref_count(block_id) > 0 or block_id in self._evictable

    def _set_slot(self, block_id: int, slot: int) -> None:
        self._fp_slot[block_id] = slot
        if self.on_fp_slot is not None:
            self.on_fp_slot(block_id, slot)

    def _check_capacity(self) -> None:
        # Blocks are limited by bytes as well as ids: free space is the smaller of the two.
        assert self.num_used + self.num_free <= max(self.num_usable, self.num_used)

    def check_invariants(self) -> None:
        super().check_invariants()
        holding = [b for b in range(self.num_blocks) if self._holds(b)]
        held = sum(self._cost(b) for b in holding)
        assert held == self._held_bytes, f"held bytes {self._held_bytes} != recount {held}"
        assert held <= self.budget_bytes, f"{held} bytes held over the budget of {self.budget_bytes}"
        evictable = sum(self._cost(b) for b in self._evictable)
        assert evictable == self._evictable_bytes, f"evictable bytes {self._evictable_bytes} != {evictable}"
        slots = [self._fp_slot[b] for b in holding if self._fp_slot[b] != NO_SLOT]
        assert all(self._fp_slot[b] == NO_SLOT for b in range(self.num_blocks) if not self._holds(b)), \
            "a free block keeps a full-precision slot"
        assert len(set(slots)) == len(slots), "a full-precision slot is shared"
        assert not set(slots) & set(self._free_fp_slots), "a full-precision slot is both used and free"
        assert len(slots) + len(self._free_fp_slots) == self.num_fp_slots, "a full-precision slot is lost"
