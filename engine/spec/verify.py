"""The forward of a speculative step: verify a row of drafts, then keep the accepted part.

Built from the runner's model and the pools it runs on (blocks, KV store, SSM slots). The verify
runs [last token, drafts] as a prefill segment of one sequence, with logits at every row:
causal attention over the cached prefix gives each row what a decode step at that position
would see. The Gated DeltaNet layers run the segment with the decode step's arithmetic and
keep the state after every row (``SSMRowStates``, one state per draft position as vLLM's
speculative state slots do), so a partial acceptance just keeps the state of its last accepted
row: no token is fed twice. K/V of rejected positions need no undo: they sit past
``num_cached_tokens`` and are overwritten by the next tokens; blocks that only held rejected
positions go back to the manager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.multimodal.chunk_inputs import shift_past_prompt
from engine.cache.pools import CachePools
from engine.cache.ssm_pool import SSMSnapshot
from engine.model.batch import build_batch
from engine.model.gdn import SSMRowStates
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState


@dataclass
class Verified:
    """What one verify forward left: logits and hidden states per row, the SSM state after each row."""

    start: int                     # cached tokens before the verify
    logits: torch.Tensor           # [k+1, V]: row i is the distribution of the token after tokens[i]
    hidden: torch.Tensor | None    # [k+1, H] main-model hidden states (asked for by the MTP keep-up)
    row_states: SSMRowStates


def verify_forward(runner: ModelRunner, seq: SequenceState, tokens: list[int], *,
                   want_hidden: bool = False) -> Verified:
    """ONE forward over ``tokens`` = [last token, draft 1 .. draft k].

    Row 0 is what a plain decode step would give; row i > 0 is valid only if drafts 1..i are
    accepted. Advances ``seq.num_cached_tokens`` by k+1 (``keep`` cuts it back).
    """
    if seq.ssm_slot is None:
        raise ValueError(f"request {seq.request_id} has no SSM slot: call admit() first")
    if not tokens:
        raise ValueError("a verify forward needs at least one token")
    bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < runner.vocab_size]
    if bad:
        raise ValueError(f"verify tokens: id(s) {bad[:5]} outside the vocabulary [0, {runner.vocab_size})")
    start = seq.num_cached_tokens
    pools = runner.pools
    pools.blocks.allocate(seq, len(tokens))  # KVCacheExhausted leaves the table as it was
    batch = build_batch((tokens, start, seq.block_table, seq.ssm_slot), [], runner.kv_block_size, runner.device)
    batch.ssm_row_states = row_states = SSMRowStates()  # read by every GatedDeltaNet layer
    shift_past_prompt(batch, seq)   # a prompt with images: M-RoPE positions
    out = runner.model(batch, pools.kv_store, pools.ssm, return_hidden=want_hidden)
    logits, hidden = out if want_hidden else (out, None)
    runner.note_forward(len(tokens), start, [], int(logits.shape[0]))
    seq.num_cached_tokens = start + len(tokens)
    return Verified(start, logits, hidden, row_states)


def keep(pools: CachePools, seq: SequenceState, verified: Verified, num_kept: int) -> None:
    """Make the caches hold the prefix plus the first ``num_kept`` verified tokens, and nothing after.

    The SSM slot gets the state after row ``num_kept - 1`` (already there when every row is kept).
    """
    num_rows = verified.logits.shape[0]
    if not 1 <= num_kept <= num_rows:
        raise ValueError(f"keep {num_kept} of {num_rows} verified tokens: at least the fed token is kept")
    if num_kept < num_rows:
        states = verified.row_states
        order = sorted(states.conv)
        if order:
            last = num_kept - 1
            snapshot = SSMSnapshot(torch.stack([states.conv[i][last] for i in order]),       # [L, C, K-1]
                                   torch.stack([states.recurrent[i][last] for i in order]))  # [L, Hv, Dk, Dv]
            pools.ssm.restore(snapshot, seq.ssm_slot)
    seq.num_cached_tokens = verified.start + num_kept
    num_blocks = pools.blocks.num_blocks_for(seq.num_cached_tokens)
    while len(seq.block_table) > num_blocks:
        pools.blocks.decref(seq.block_table.pop())
