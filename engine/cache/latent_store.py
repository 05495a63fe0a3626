"""Paged latent K/V for multi-head latent attention (MLA): one compressed row per token and layer.

Where the GQA store (kv_store.py) keeps every K/V head of a token, an MLA layer keeps one row of
``kv_lora_rank + qk_rope_head_dim`` values: the normed kv latent and the key part all heads
share. Keys and values are up-projected from it when a layer reads it (or folded into the
query and the output, the absorbed decode form: engine/model/mla.py). The rows live in the same
paged blocks as any K/V, so the block manager, the prefix cache (block hashes), preemption and
the block tables work on them unchanged; only a block's size differs, which ``block_bytes`` gives.
"""
from __future__ import annotations

import torch

from engine.cache.kv import BlockManager


def latent_block_bytes(num_layers: int, block_size: int, latent_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block across the latent layers."""
    return num_layers * block_size * latent_dim * dtype.itemsize


class LatentKVStore:
    """One tensor per MLA layer: ``[num_blocks, block_size, latent_dim]``.

    Written through flat slot indices (``block * block_size + offset``) like ``KVStore``; read
    by gathering a sequence's blocks (decode) or a bounded token range of them (chunked prefill).
    """

    def __init__(self, layer_ids: list[int], num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 scratch_block: bool = False):
        if num_blocks <= 0 or block_size <= 0 or latent_dim <= 0:
            raise ValueError(f"LatentKVStore needs num_blocks, block_size and latent_dim > 0, got "
                             f"{num_blocks}, {block_size}, {latent_dim}")
        self.num_blocks, self.block_size, self.latent_dim = num_blocks, block_size, latent_dim
        self.scratch_block_id: int | None = num_blocks if scratch_block else None
        shape = (num_blocks + int(scratch_block), block_size, latent_dim)
        self.latents = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.block_bytes = latent_block_bytes(len(layer_ids), block_size, latent_dim, dtype)

    def begin_forward(self, num_prefill_rows: int) -> None:
        """Nothing to note (the GQA stores' hook: a quantized store calibrates on prefill keys)."""

    def write(self, layer_id: int, kv_slots: torch.Tensor, latent: torch.Tensor) -> None:
        """kv_slots: [T]; latent: [T, latent_dim]."""
        self.latents[layer_id].view(-1, self.latent_dim).index_copy_(0, kv_slots, latent)

    def gather(self, layer_id: int, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids: [..., n] -> latents [..., n * block_size, latent_dim]."""
        rows = self.latents[layer_id].index_select(0, block_ids.reshape(-1))
        return rows.view(*block_ids.shape[:-1], -1, self.latent_dim)

    def gather_tokens(self, layer_id: int, block_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The latents of token positions [start, end) of one sequence (block_ids [n]): [end - start, latent_dim].

        Only the blocks that hold those positions are read, so a bounded range costs a bounded gather.
        """
        first, last = start // self.block_size, -(-end // self.block_size)
        rows = self.gather(layer_id, block_ids[first:last])  # [(last - first) * block, latent_dim]
        offset = start - first * self.block_size
        return rows[offset: offset + end - start]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latents.values())


def build_latent_cache(layer_ids: list[int], num_blocks: int, block_size: int, latent_dim: int,
                       dtype: torch.dtype, device: torch.device | str, budget_bytes: int | None = None,
                       scratch_block: bool = False) -> tuple[BlockManager, LatentKVStore]:
    """An MLA model's paged cache: the GQA cache's block manager over latent blocks.

    ``budget_bytes`` (--kv-cache-mb) sizes it in latent blocks instead of ``num_blocks``: the same
    megabytes hold ``full_kv_width / latent_dim`` times the tokens a per-head cache would.
    """
    if budget_bytes is not None:
        block_bytes = latent_block_bytes(len(layer_ids), block_size, latent_dim, dtype)
        num_blocks = budget_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-mb: {budget_bytes} bytes hold no latent KV block ({block_bytes} bytes each)")
    store = LatentKVStore(layer_ids, num_blocks, block_size, latent_dim, dtype=dtype, device=device,
                          scratch_block=scratch_block)
    return BlockManager(num_blocks, block_size), store
