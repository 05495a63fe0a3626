"""Fixed slots holding each sequence's Gated DeltaNet state (conv window + recurrent matrix) in every linear layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


class SSMPoolExhausted(RuntimeError):
    """Every SSM slot is owned by a live sequence."""


@dataclass(frozen=True)
class SSMSnapshot:
    """A private copy of one slot: conv ``[L, conv_dim, K-1]`` and recurrent ``[L, Hv, Dk, Dv]``."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class SSMPool:
    """``num_slots`` slots; slot ``s`` of linear layer ``i`` lives at ``conv[i, s]`` and ``recurrent[i, s]``.

    States stay float32 whatever the weight dtype: the recurrence accumulates over the whole
    sequence and bf16 drift there shows up as wrong tokens long after the prompt.
    """

    def __init__(self, num_slots: int, num_linear_layers: int, conv_dim: int, conv_kernel: int,
                 num_value_heads: int, key_head_dim: int, value_head_dim: int,
                 device: torch.device | str = "cpu", scratch_slot: bool = False):
        """``scratch_slot``: one more slot past the last, never handed out (``scratch_slot_id``): the
        compiled decode step's padding rows read and write their state there."""
        if num_slots <= 0:
            raise ValueError(f"SSMPool needs num_slots > 0, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot_id: int | None = num_slots if scratch_slot else None
        layers, rows = max(num_linear_layers, 1), num_slots + int(scratch_slot)
        self.conv = torch.zeros(layers, rows, conv_dim, conv_kernel - 1, device=device)
        self.recurrent = torch.zeros(layers, rows, num_value_heads, key_head_dim, value_head_dim,
                                     device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._used: set[int] = set()
        # Slots written outside a forward since the last expert-parallel broadcast (None: not tracked).
        # Rank 0 sends their states to the other ranks before the next forward.
        self.dirty: set[int] | None = None

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Hand out a free slot with zeroed state (a new sequence starts from zero state)."""
        if not self._free:
            raise SSMPoolExhausted(f"SSM pool exhausted: all {self.num_slots} slots in use")
        slot = self._free.pop()
        self._used.add(slot)
        self.zero(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"SSM slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        self._check_owned(slot)
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        self._mark(slot)

    def snapshot(self, slot: int) -> SSMSnapshot:
        self._check_owned(slot)
        return SSMSnapshot(self.conv[:, slot].clone(), self.recurrent[:, slot].clone())

    def restore(self, snapshot: SSMSnapshot, slot: int) -> None:
        self._check_owned(slot)
        if snapshot.conv.shape != self.conv[:, slot].shape or \
                snapshot.recurrent.shape != self.recurrent[:, slot].shape:
            raise ValueError("SSM snapshot shape does not match this pool")
        self.conv[:, slot].copy_(snapshot.conv)
        self.recurrent[:, slot].copy_(snapshot.recurrent)
        self._mark(slot)

    def snapshot_slots(self, slots: list[int]) -> SSMSnapshot:
        """One copy of several slots: conv ``[L, B, conv_dim, K-1]``, recurrent ``[L, B, Hv, Dk, Dv]``."""
        for slot in slots:
            self._check_owned(slot)
        index = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        return SSMSnapshot(self.conv.index_select(1, index), self.recurrent.index_select(1, index))

    def restore_slots(self, snapshot: SSMSnapshot, slots: list[int]) -> None:
        """Put a ``snapshot_slots`` copy back into the same slots."""
        for slot in slots:
            self._check_owned(slot)
        if snapshot.conv.shape[1] != len(slots):
            raise ValueError(f"SSM snapshot holds {snapshot.conv.shape[1]} slots, asked to restore {len(slots)}")
        index = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        self.conv.index_copy_(1, index, snapshot.conv)
        self.recurrent.index_copy_(1, index, snapshot.recurrent)
        for slot in slots:
            self._mark(slot)

    def write_rows(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """A forward's new states for ``slots`` [B] of linear layer ``layer``: conv [B, C, K-1], recurrent
        [B, Hv, Dk, Dv]. Eager copies into the layer's view; a compiled graph writes the base tensors by
        (layer, slot) instead: inductor turns a write into a view of a graph input into a copy of the
        whole layer (every slot, each step), and a write into the input itself into an in-place one."""
        if not torch.compiler.is_compiling():
            self.conv[layer].index_copy_(0, slots, conv)
            self.recurrent[layer].index_copy_(0, slots, recurrent)
            return
        layers = torch.full_like(slots, layer)
        self.conv.index_put_((layers, slots), conv)
        self.recurrent.index_put_((layers, slots), recurrent)

    def normalize(self, slot: int, max_norm: float) -> bool:
        """Scale down any head whose recurrent-state Frobenius norm exceeds ``max_norm``.

        Returns whether any head had to be scaled (a long run of near-1 decays can let the
        state grow; bounding it keeps the output finite at the cost of exactness).
        """
        self._check_owned(slot)
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        state = self.recurrent[:, slot]  # [L, Hv, Dk, Dv]
        norms = torch.linalg.vector_norm(state, dim=(-2, -1))  # [L, Hv]
        too_big = norms > max_norm
        if not bool(too_big.any()) and bool(torch.isfinite(norms).all()):
            return False
        state.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        norms = torch.linalg.vector_norm(state, dim=(-2, -1))
        scale = torch.where(norms > max_norm, max_norm / norms.clamp_min(1e-30), torch.ones_like(norms))
        state.mul_(scale[..., None, None])
        self._mark(slot)
        return True

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "SSM pool: a slot is on the free list twice"
        assert not (free & self._used), "SSM pool: a slot is both free and used"
        assert free | self._used == set(range(self.num_slots)), "SSM pool: a slot went missing"
        assert self.num_used + self.num_free == self.num_slots

    def _mark(self, slot: int) -> None:
        if self.dirty is not None:
            self.dirty.add(slot)

    def _check_owned(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"SSM slot {slot} is not allocated")
