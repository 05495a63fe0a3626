"""The forwards of a speculative step: verify a row of drafts, and roll a partial acceptance back.

Built from the runner's public pieces (model, block manager, KV store, SSM pool)
so the runner itself stays as it is. The verify runs the drafted tokens as a
prefill segment of one sequence: the chunked Gated DeltaNet rule and causal
attention over the cached prefix give each row exactly what a decode step at
that position would see, in one forward, with logits at every row.

A rejected draft has already passed through the SSM recurrence, and a
recurrent state cannot be un-applied; so a partial acceptance restores the
state snapshot taken before the verify and replays the accepted tokens
(a second, shorter forward). K/V of rejected positions need no undo: they
sit past ``num_cached_tokens`` and are overwritten by the next tokens; the
blocks that only held rejected positions go back to the manager.
"""
from __future__ import annotations

import torch

from engine.cache.ssm_pool import SSMSnapshot
from engine.model.batch import build_batch
from engine.model.runner import ModelRunner
from engine.sequence import SequenceState


def _forward_segment(runner: ModelRunner, seq: SequenceState, tokens: list[int],
                     logits_rows: torch.Tensor | None) -> torch.Tensor:
    """Run ``tokens`` for ``seq`` from its cached length; K/V blocks are allocated first (all or nothing)."""
    if seq.ssm_slot is None:
        raise ValueError(f"request {seq.request_id} has no SSM slot: call admit() first")
    if not tokens:
        raise ValueError("a verify forward needs at least one token")
    bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < runner.vocab_size]
    if bad:
        raise ValueError(f"verify tokens: id(s) {bad[:5]} outside the vocabulary [0, {runner.vocab_size})")
    runner.block_manager.allocate(seq, len(tokens))  # KVCacheExhausted leaves the table as it was
    batch = build_batch((tokens, seq.num_cached_tokens, seq.block_table, seq.ssm_slot), [],
                        runner.kv_block_size, runner.device)
    logits = runner.model(batch, runner.kv_store, runner.ssm_pool, logits_rows)  # [R, V]
    seq.num_cached_tokens += len(tokens)
    return logits


def verify_forward(runner: ModelRunner, seq: SequenceState, tokens: list[int]) -> torch.Tensor:
    """ONE forward over ``tokens`` = [last token, draft 1 .. draft k]; logits [k+1, V] at every row.

    Row i holds the distribution of the token after ``tokens[i]``: row 0 is what a plain
    decode step would give, row i > 0 is valid only if drafts 1..i are accepted.
    Advances ``seq.num_cached_tokens`` by k+1 (``roll_back`` undoes the rejected part).
    """
    return _forward_segment(runner, seq, tokens, None)


def roll_back(runner: ModelRunner, seq: SequenceState, snapshot: SSMSnapshot, start: int,
              keep_tokens: list[int]) -> None:
    """Make the caches hold the prefix up to ``start`` plus ``keep_tokens`` and nothing of the rejected drafts.

    ``snapshot`` is the SSM slot as it was when ``start`` tokens were cached (before the verify).
    """
    if not 0 <= start <= seq.num_cached_tokens:
        raise ValueError(f"roll back to {start} tokens, but {seq.num_cached_tokens} are cached")
    runner.ssm_pool.restore(snapshot, seq.ssm_slot)
    seq.num_cached_tokens = start
    num_blocks = runner.block_manager.num_blocks_for(start + len(keep_tokens))
    while len(seq.block_table) > num_blocks:
        runner.block_manager.decref(seq.block_table.pop())
    if len(keep_tokens) == 1:
        # Every draft rejected: the replay is exactly one plain decode step (the cheaper kernels).
        runner.decode([seq], keep_tokens)
    elif keep_tokens:
        # Only the state matters here; ask for one row of logits to keep the head cheap.
        last_row = torch.tensor([len(keep_tokens) - 1], dtype=torch.long, device=runner.device)
        _forward_segment(runner, seq, keep_tokens, last_row)
