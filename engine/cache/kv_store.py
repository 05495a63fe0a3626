"""Paged K/V tensors for the full-attention layers (the block manager decides who owns which block)."""
from __future__ import annotations

import torch


class KVStore:
    """One K and one V tensor per full-attention layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Layers write new K/V through flat slot indices (``block * block_size + offset``) and read a
    sequence's context by gathering its blocks with its block table.
    """

    def __init__(self, layer_ids: list[int], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 scratch_block: bool = False):
        """``scratch_block``: one more block past the last, outside the block manager's range
        (``scratch_block_id``): the compiled decode step's padding rows write their K/V there."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KVStore needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block_id: int | None = num_blocks if scratch_block else None
        shape = (num_blocks + int(scratch_block), block_size, num_kv_heads, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}

    def begin_forward(self, num_prefill_rows: int) -> None:
        """Nothing to note: a full-precision store does not calibrate (see ``QuantKVStore``)."""

    def scale_query(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Queries as they are: full-precision keys are stored unnormalized."""
        return q

    def write(self, layer_id: int, kv_slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """kv_slots: [T]; key/value: [T, num_kv_heads, head_dim]."""
        if torch.compiler.is_compiling():
            # Written by (block, offset) into the store itself: inductor turns a write into a view of a
            # graph input into a copy of the whole store per layer and step (the compiled decode step).
            blocks, offsets = kv_slots // self.block_size, kv_slots % self.block_size
            self.keys[layer_id].index_put_((blocks, offsets), key)
            self.values[layer_id].index_put_((blocks, offsets), value)
            return
        kv_heads, head_dim = key.shape[1:]
        self.keys[layer_id].view(-1, kv_heads, head_dim).index_copy_(0, kv_slots, key)
        self.values[layer_id].view(-1, kv_heads, head_dim).index_copy_(0, kv_slots, value)

    def gather(self, layer_id: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids: [..., n] -> K, V of shape [..., n * block_size, num_kv_heads, head_dim]."""
        keys, values = self.keys[layer_id], self.values[layer_id]
        lead = block_ids.shape
        k = keys.index_select(0, block_ids.reshape(-1))
        v = values.index_select(0, block_ids.reshape(-1))
        return (k.view(*lead[:-1], -1, *keys.shape[2:]), v.view(*lead[:-1], -1, *values.shape[2:]))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
