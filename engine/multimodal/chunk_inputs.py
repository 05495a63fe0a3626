"""What a forward needs from its sequences' images: M-RoPE positions and the placeholder rows' embeddings.

The prefill chunk's rows take their slice of the prompt's precomputed positions; a decode row
of a sequence with images sits at its index plus the prompt's delta (the same on all three
axes). The embeddings of the image rows a chunk covers come from the encoder cache, the tower
running for an image the first time a chunk covers any of its tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.sequence import SequenceState
from engine.model.batch import PackedBatch
from engine.multimodal.encoder_cache import EncoderCache


def attach_images(batch: PackedBatch, prefill_seq: SequenceState | None, offset: int, length: int,
                  decode_seqs: Sequence[SequenceState], tower, cache: EncoderCache) -> list:
    """Set ``batch.rope_positions`` / ``image_rows`` / ``image_embeds`` when any sequence has images.

    Returns the covered spans of the chunk (``PromptImages.covered``), empty without images.
    """
    prefill_images = prefill_seq.images if prefill_seq is not None else None
    if prefill_images is None and not any(seq.images is not None for seq in decode_seqs):
        return []
    device = batch.positions.device
    rope = batch.positions[None, :].expand(3, -1).clone()  # [3, T]
    if prefill_images is not None:
        rope[:, :length] = prefill_images.rope_positions(offset, length).to(device)
    for row, seq in enumerate(decode_seqs, start=length):
        if seq.images is not None:
            rope[:, row] += seq.images.delta
    batch.rope_positions = rope
    covered = prefill_images.covered(offset, length) if prefill_images is not None else []
    if covered:
        pieces, rows = [], []
        for part in covered:
            image = part.span.image
            embeds = cache.get(image.content_hash, lambda image=image: tower(image.patches.to(device), image.grid))
            pieces.append(embeds[part.first: part.end])  # [n, hidden]
            rows.append(torch.arange(part.row, part.row + part.end - part.first))
        batch.image_rows = torch.cat(rows).to(device)
        batch.image_embeds = torch.cat(pieces)
    return covered


def shift_past_prompt(batch: PackedBatch, seq: SequenceState) -> None:
    """A forward whose rows are all ``seq``'s tokens past its prompt (a speculative verify or draft):
    with images, each row sits at its index plus the prompt's delta on all three axes."""
    images = getattr(seq, "images", None)   # callers may pass a bare stand-in with the cache fields only
    if images is not None:
        batch.rope_positions = (batch.positions + images.delta)[None, :].expand(3, -1)
