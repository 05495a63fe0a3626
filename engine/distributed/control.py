"""Rank 0's broadcast before every forward, and the other ranks' receiving side.

The reference's EP broadcast: a control word (forward follows / idle keepalive / stop), then
the forward's inputs: token ids, positions, K/V slots, the logits rows, the cache layout
(prefill block ids and SSM slot, decode block tables, context lengths and SSM slots), the
mid-chunk capture point, a prompt with images' M-RoPE positions and image rows, and the SSM
slots rank 0 wrote outside a forward (admission zeroing, prefix-snapshot restores,
normalization) with their states, so every rank's SSM pool holds the same state when the forward
starts. Three broadcasts: a fixed header, one int64 payload, and the float32 states when any slot
changed (the image rows' embeddings follow in ``vision_sync.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.cache.ssm_pool import SSMPool
from engine.distributed.group import EPGroup, collective
from engine.model.batch import DecodeGroup, PackedBatch, PrefillSegment
from engine.model.gdn import SSMCapture

OP_FORWARD, OP_IDLE, OP_STOP = 1, 2, 3
HEADER_LEN = 14
# Header fields (int64): what follows and the sizes needed to split the payload.
(H_OP, H_TOKENS, H_ROWS, H_PREFILL_START, H_PREFILL_LEN, H_PREFILL_SLOT, H_PREFILL_BLOCKS, H_DECODES,
 H_MAX_BLOCKS, H_CAPTURE, H_DIRTY, H_BLOCK_SIZE, H_ROPE, H_IMAGE_ROWS) = range(HEADER_LEN)


def _header(op: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.long)
    header[H_OP] = op
    return header


def send_control(group: EPGroup, op: int, device: torch.device) -> None:
    """A bare control word: idle keepalive or stop."""
    with collective(group, "control broadcast"):
        dist.broadcast(_header(op).to(device), src=0)


def send_forward(group: EPGroup, batch: PackedBatch, rows: torch.Tensor | None, pool: SSMPool,
                 block_size: int) -> None:
    """Rank 0: broadcast everything the other ranks need to run the same forward."""
    header = _header(OP_FORWARD)
    header[H_TOKENS], header[H_BLOCK_SIZE] = batch.num_tokens, block_size
    ints = [batch.token_ids, batch.positions, batch.kv_slots]
    header[H_ROWS] = -1 if rows is None else rows.numel()
    if rows is not None:
        ints.append(rows)
    header[H_PREFILL_START] = -1
    if batch.prefill is not None:
        p = batch.prefill
        header[H_PREFILL_START], header[H_PREFILL_LEN], header[H_PREFILL_SLOT] = p.start, p.length, p.ssm_slot
        header[H_PREFILL_BLOCKS] = p.block_ids.numel()
        ints.append(p.block_ids)
    if batch.decode is not None:
        d = batch.decode
        header[H_DECODES], header[H_MAX_BLOCKS] = d.ssm_slots.numel(), d.block_tables.shape[1]
        ints += [d.ssm_slots, d.block_tables.reshape(-1), d.context_lens]
    if pool.dirty is None:
        pool.dirty = set(range(pool.num_slots))  # first forward over this pool: every slot once, then changes
    capture = getattr(batch, "ssm_capture", None)
    header[H_CAPTURE] = -1 if capture is None else capture.num_rows
    dirty = sorted(pool.dirty) if pool.dirty else []
    header[H_DIRTY] = len(dirty)
    device = batch.token_ids.device
    if dirty:
        ints.append(torch.tensor(dirty, dtype=torch.long, device=device))
    header[H_ROPE] = int(batch.rope_positions is not None)
    if batch.rope_positions is not None:
        ints.append(batch.rope_positions)  # [3, T]
    header[H_IMAGE_ROWS] = 0 if batch.image_rows is None else batch.image_rows.numel()
    if batch.image_rows is not None:
        ints.append(batch.image_rows)
    payload = torch.cat([t.reshape(-1).to(device=device, dtype=torch.long) for t in ints])
    with collective(group, "forward broadcast"):
        dist.broadcast(header.to(device), src=0)
        dist.broadcast(payload, src=0)
        if dirty:
            dist.broadcast(_pack_states(pool, dirty), src=0)
    pool.dirty.clear()


def receive(group: EPGroup, pool: SSMPool, device: torch.device):
    """Rank > 0: the next control word; for a forward also (batch, rows), with dirty SSM slots applied.

    Returns (op, batch or None, rows or None).
    """
    header = torch.empty(HEADER_LEN, dtype=torch.long, device=device)
    with collective(group, "control broadcast (waiting for rank 0)"):
        dist.broadcast(header, src=0)
    h = header.tolist()
    if h[H_OP] != OP_FORWARD:
        return h[H_OP], None, None
    tokens, num_rows, num_decodes, max_blocks = h[H_TOKENS], h[H_ROWS], h[H_DECODES], h[H_MAX_BLOCKS]
    sizes = [tokens] * 3 + [max(num_rows, 0)]
    sizes += [h[H_PREFILL_BLOCKS]] if h[H_PREFILL_START] >= 0 else [0]
    sizes += [num_decodes, num_decodes * max_blocks, num_decodes, h[H_DIRTY], 3 * tokens * h[H_ROPE], h[H_IMAGE_ROWS]]
    payload = torch.empty(sum(sizes), dtype=torch.long, device=device)
    with collective(group, "forward broadcast (receiving)"):
        dist.broadcast(payload, src=0)
    (token_ids, positions, kv_slots, rows, block_ids, slots, tables, context_lens,
     dirty, rope, image_rows) = payload.split(sizes)
    if h[H_DIRTY]:
        states = torch.empty(_state_numel(pool, h[H_DIRTY]), dtype=pool.conv.dtype, device=device)
        with collective(group, "SSM state broadcast (receiving)"):
            dist.broadcast(states, src=0)
        _unpack_states(pool, dirty.tolist(), states)
    prefill = None
    if h[H_PREFILL_START] >= 0:
        prefill = PrefillSegment(h[H_PREFILL_START], h[H_PREFILL_LEN], h[H_PREFILL_SLOT], block_ids)
    decode = None
    if num_decodes:
        decode = decode_group(slots, tables.reshape(num_decodes, max_blocks), context_lens, h[H_BLOCK_SIZE])
    batch = PackedBatch(token_ids, positions, kv_slots, prefill, decode,
                        rope_positions=rope.view(3, tokens) if h[H_ROPE] else None,
                        image_rows=image_rows if h[H_IMAGE_ROWS] else None)
    if h[H_CAPTURE] >= 0:
        batch.ssm_capture = SSMCapture(num_rows=h[H_CAPTURE])  # same split of the chunk as on rank 0
    return OP_FORWARD, batch, (rows if num_rows >= 0 else None)


def decode_group(slots: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int) -> DecodeGroup:
    """The decode rows' layout with the derived fields ``build_batch`` makes (visibility mask, slot range)."""
    columns = torch.arange(tables.shape[1] * block_size, device=tables.device)
    slot_list = slots.tolist()
    first = slot_list[0]
    consecutive = slot_list == list(range(first, first + len(slot_list)))
    return DecodeGroup(ssm_slots=slots, block_tables=tables, context_lens=context_lens,
                       visible=(columns[None, :] < context_lens[:, None])[:, None, None, :],
                       slot_range=(first, first + len(slot_list)) if consecutive else None)


def _state_numel(pool: SSMPool, num_slots: int) -> int:
    per_slot = pool.conv[:, 0].numel() + pool.recurrent[:, 0].numel()
    return per_slot * num_slots


def _pack_states(pool: SSMPool, slots: list[int]) -> torch.Tensor:
    index = torch.tensor(slots, dtype=torch.long, device=pool.conv.device)
    return torch.cat([pool.conv.index_select(1, index).reshape(-1),
                      pool.recurrent.index_select(1, index).reshape(-1)])


def _unpack_states(pool: SSMPool, slots: list[int], states: torch.Tensor) -> None:
    index = torch.tensor(slots, dtype=torch.long, device=pool.conv.device)
    conv_shape = (pool.conv.shape[0], len(slots), *pool.conv.shape[2:])  # [L, D, C, K-1]
    rec_shape = (pool.recurrent.shape[0], len(slots), *pool.recurrent.shape[2:])  # [L, D, Hv, Dk, Dv]
    conv_numel = pool.conv[:, 0].numel() * len(slots)
    pool.conv.index_copy_(1, index, states[:conv_numel].view(conv_shape))
    pool.recurrent.index_copy_(1, index, states[conv_numel:].view(rec_shape))
