"""Feeding the MTP layer: keep its K/V in step with the main model, and draft from it.

The MTP row at position p pairs the token at p + 1 with the main model's hidden state at p
(engine/model/mtp.py), so the MTP K/V lags the main caches by one position: after a forward
over positions [a, b) the MTP rows a-1 .. b-2 can run (their next tokens are known), and
h_{b-1} waits in ``seq.mtp_hidden`` for the token at b. A sequence without a waiting hidden
state (its first chunk, a prefix-cache hit, or MTP switched on mid-sequence) starts its rows
one position later; the rows it skipped stay unwritten, which can only lower its acceptance:
drafts are checked by the full model, never trusted.

A block shared through the prefix cache may get its last MTP row rewritten by a sequence whose
next token differs; again only draft quality can change.
"""
from __future__ import annotations

import torch

from engine.cache.kv_store import KVStore
from engine.model.batch import PackedBatch, build_batch
from engine.model.mtp import mtp_forward
from engine.cache.sequence import SequenceState


def keep_up(model, kv: KVStore, block_size: int, batch: PackedBatch, hidden: torch.Tensor,
            prefill_seq: SequenceState | None, decode_seqs: list[SequenceState]) -> None:
    """Run the MTP rows that the main forward over ``batch`` made possible (writes MTP K/V only).

    Call it after the main forward and BEFORE the decode sequences' cached counts advance (a
    prefill segment's start comes from the batch).
    ``hidden``: [T, H] the main model's normed hidden state of every row of ``batch``.
    """
    tokens = batch.token_ids
    split = batch.num_prefill_tokens
    prefill = None
    parts: list[torch.Tensor] = []
    if prefill_seq is not None and split:
        start, pending = batch.prefill.start, prefill_seq.mtp_hidden
        if pending is not None and start > 0:
            # Rows start-1 .. start+L-2: tokens t_start.., hiddens h_{start-1} (waiting), h_start..
            prefill = (tokens[:split].tolist(), start - 1, prefill_seq.block_table, prefill_seq.ssm_slot)
            parts += [pending[None], hidden[:split - 1]]
        elif split > 1:
            prefill = (tokens[1:split].tolist(), start, prefill_seq.block_table, prefill_seq.ssm_slot)
            parts.append(hidden[:split - 1])
        prefill_seq.mtp_hidden = hidden[split - 1].clone()
    decodes = []
    for row, seq in enumerate(decode_seqs, start=split):
        if seq.mtp_hidden is not None:
            # Row at position p-1: (token at p, h_{p-1}); p is the decode row's position.
            decodes.append((int(tokens[row]), seq.num_cached_tokens - 1, seq.block_table, seq.ssm_slot))
            parts.append(seq.mtp_hidden[None])
        seq.mtp_hidden = hidden[row].clone()
    if prefill is None and not decodes:
        return
    mtp_batch = build_batch(prefill, decodes, block_size, hidden.device)
    mtp_forward(model, mtp_batch.token_ids, torch.cat(parts), mtp_batch, kv)


def keep_up_segment(model, kv: KVStore, block_size: int, seq: SequenceState, tokens: list[int],
                    start: int, hidden: torch.Tensor) -> None:
    """After a verify keeps ``tokens`` (at positions start.., main hidden states ``hidden`` [n, H]):
    the MTP rows they make possible, exactly as for a prefill chunk at ``start``."""
    batch = build_batch((tokens, start, seq.block_table, seq.ssm_slot), [], block_size, hidden.device)
    keep_up(model, kv, block_size, batch, hidden, seq, [])


@torch.inference_mode()
def draft(model, kv: KVStore, block_size: int, seq: SequenceState, token: int, num_drafts: int) -> list[int]:
    """Up to ``num_drafts`` greedy MTP drafts after ``token`` (the token the next step feeds in).

    Row 0 sits at position n-1 (n = cached tokens) with (token, seq.mtp_hidden); each further row
    feeds the previous draft with the MTP's own hidden state, one position on, reusing the layers
    (step i uses layer i % num_layers). Needs blocks up to position n + num_drafts - 2 (the caller
    allocates). Returns [] when no hidden state waits (the sequence has no MTP history yet).
    """
    if seq.mtp_hidden is None or num_drafts < 1:
        return []
    drafts: list[int] = []
    hidden = seq.mtp_hidden[None]  # [1, H]
    position = seq.num_cached_tokens - 1
    rows = torch.zeros(1, dtype=torch.long, device=hidden.device)
    for step in range(num_drafts):
        batch = build_batch(None, [(token, position + step, seq.block_table, seq.ssm_slot)], block_size,
                            hidden.device)
        hidden, logits = mtp_forward(model, batch.token_ids, hidden, batch, kv, step=step, logits_rows=rows)
        token = int(logits[0].argmax())
        drafts.append(token)
    return drafts
