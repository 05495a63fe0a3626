"""The packed token layout of one forward: an optional prefill segment, then decode rows.

Rows ``0 .. prefill.length-1`` hold the prefill chunk, the remaining rows hold one token
per decoding sequence. Everything the layers index with (cache slots, block tables,
context lengths, SSM slots) is built here once per forward, so layers do no Python work
per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSegment:
    start: int  # position of the first token of the chunk (tokens already cached before it)
    length: int
    ssm_slot: int
    block_ids: torch.Tensor  # [num_blocks covering start + length] long


@dataclass
class DecodeGroup:
    ssm_slots: torch.Tensor  # [B] long
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with block 0 (masked out)
    context_lens: torch.Tensor  # [B] long: tokens visible to each row, its own included
    # [B, 1, 1, max_blocks * block_size] bool: which gathered key columns each row may see.
    # Built once per forward here instead of once per attention layer.
    visible: torch.Tensor | None = None
    # (first, end) when the SSM slots are first, first+1, .., end-1: the GDN layers then work on a
    # view of the pool in place instead of gathering and scattering every layer's state.
    slot_range: tuple[int, int] | None = None


@dataclass
class PackedBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    kv_slots: torch.Tensor  # [T] long: flat index block * block_size + offset for the new K/V
    prefill: PrefillSegment | None
    decode: DecodeGroup | None
    # A prompt with images (engine/multimodal/): the rotary's (t, h, w) positions [3, T] (None: the
    # plain ``positions``), and the rows whose embeddings are the vision tower's instead of the
    # token table's (``image_rows`` [N] long, ``image_embeds`` [N, hidden]).
    rope_positions: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_prefill_tokens(self) -> int:
        return self.prefill.length if self.prefill is not None else 0


def _kv_slots(block_table: list[int], positions: range, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def _consecutive_range(slots: list[int]) -> tuple[int, int] | None:
    first = slots[0]
    return (first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None


def build_batch(prefill: tuple[list[int], int, list[int], int] | None,
                decodes: list[tuple[int, int, list[int], int]],
                block_size: int, device: torch.device | str = "cpu") -> PackedBatch:
    """Pack a forward.

    prefill: (chunk token ids, start position, block table, ssm slot) or None.
    decodes: one (token id, position, block table, ssm slot) per decoding sequence.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    kv_slots: list[int] = []
    prefill_segment = None
    if prefill is not None:
        chunk, start, table, slot = prefill
        span = range(start, start + len(chunk))
        token_ids += chunk
        positions += list(span)
        kv_slots += _kv_slots(table, span, block_size)
        num_blocks = -(-(start + len(chunk)) // block_size)
        prefill_segment = PrefillSegment(start, len(chunk), slot,
                                         torch.tensor(table[:num_blocks], dtype=torch.long, device=device))
    decode_group = None
    if decodes:
        max_blocks = max(-(-(pos + 1) // block_size) for _, pos, _, _ in decodes)
        tables = []
        for token, pos, table, _ in decodes:
            token_ids.append(token)
            positions.append(pos)
            kv_slots += _kv_slots(table, range(pos, pos + 1), block_size)
            used = table[: -(-(pos + 1) // block_size)]
            tables.append(used + [0] * (max_blocks - len(used)))
        slots = [slot for *_, slot in decodes]
        context_lens = torch.tensor([pos + 1 for _, pos, _, _ in decodes], dtype=torch.long, device=device)
        columns = torch.arange(max_blocks * block_size, device=device)
        decode_group = DecodeGroup(
            ssm_slots=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
            context_lens=context_lens,
            visible=(columns[None, :] < context_lens[:, None])[:, None, None, :],
            slot_range=_consecutive_range(slots))
    as_long = dict(dtype=torch.long, device=device)
    return PackedBatch(torch.tensor(token_ids, **as_long), torch.tensor(positions, **as_long),
                        torch.tensor(kv_slots, **as_long), prefill_segment, decode_group)
