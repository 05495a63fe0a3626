"""The reference's ``ep_sync_vision_embeds``: after a chunk's broadcast, the image rows' embeddings.

Rank 0 alone runs the vision tower (through the encoder cache); the other ranks need the rows
of the images their copy of the chunk covers to replace the placeholder embeddings. The forward
broadcast (``control.py``) already carried which rows; this is one more broadcast, of those rows
([N, hidden] in the model's dtype), skipped when the chunk covers no image. Rank 0 times it and
the chunk row records it (``ep_vision_sync_ns``), as ``ep_broadcast_ns`` records the broadcast.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.distributed.group import EPGroup, collective
from engine.model.batch import PackedBatch


def send(group: EPGroup, batch: PackedBatch) -> bool:
    """Rank 0: broadcast ``batch.image_embeds`` when the forward has image rows; True when it did."""
    if batch.image_rows is None:
        return False
    with collective(group, "vision embeddings broadcast"):
        dist.broadcast(batch.image_embeds.contiguous(), src=0)
    return True


def receive(group: EPGroup, batch: PackedBatch, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Rank > 0: the embeddings of ``batch.image_rows`` (which the forward broadcast named), into the batch."""
    if batch.image_rows is None:
        return
    embeds = torch.empty(batch.image_rows.numel(), hidden_size, dtype=dtype, device=device)
    with collective(group, "vision embeddings broadcast (receiving)"):
        dist.broadcast(embeds, src=0)
    batch.image_embeds = embeds
