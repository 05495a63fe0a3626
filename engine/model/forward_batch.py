"""What one forward computes, as a value the runner runs: an optional prefill chunk, then decode rows.

The scheduler builds a ``ForwardBatch`` (``ForwardBatch.chunk`` / ``.decode`` / ``.mixed``) and the
runner returns a ``ForwardOutput``; the packed tensor layout the layers read is ``batch.py``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.sequence import SequenceState
from engine.cache.ssm_pool import SSMSnapshot


@dataclass(frozen=True)
class PrefillChunk:
    """prompt[offset:offset+length] of one sequence; logits at its last token when ``is_last``.

    ``capture_at`` (offset < capture_at < offset+length): also capture the SSM state after
    prompt[:capture_at] (``ForwardOutput.capture``) without splitting the chunk. ``every_row``: the
    logits of every chunk row too (``ForwardOutput.chunk_logits``), for prompt logprobs."""

    seq: SequenceState
    prompt: Sequence[int]
    offset: int
    length: int
    is_last: bool
    capture_at: int | None = None
    every_row: bool = False


@dataclass(frozen=True)
class ForwardBatch:
    """ONE forward over [prefill chunk rows | one row per decoding sequence]."""

    decode_seqs: Sequence[SequenceState] = ()
    decode_tokens: Sequence[int] = ()
    prefill: PrefillChunk | None = None

    @classmethod
    def chunk(cls, seq: SequenceState, prompt: Sequence[int], offset: int, length: int, is_last: bool,
              capture_at: int | None = None) -> ForwardBatch:
        return cls(prefill=PrefillChunk(seq, prompt, offset, length, is_last, capture_at))

    @classmethod
    def decode(cls, seqs: Sequence[SequenceState], tokens: Sequence[int]) -> ForwardBatch:
        return cls(seqs, tokens)

    @classmethod
    def mixed(cls, seqs: Sequence[SequenceState], tokens: Sequence[int], chunk: PrefillChunk) -> ForwardBatch:
        return cls(seqs, tokens, chunk)

    @property
    def sequences(self) -> list[SequenceState]:
        """Every sequence the forward advances, decode rows first (the order blocks are allocated in)."""
        return list(self.decode_seqs) + ([self.prefill.seq] if self.prefill is not None else [])


@dataclass(frozen=True)
class ForwardOutput:
    prefill_logits: torch.Tensor | None   # [V] at the chunk's last token (a last chunk), else None
    decode_logits: torch.Tensor           # [B, V], rows in ``decode_seqs`` order
    capture: SSMSnapshot | None = None    # the state ``capture_at`` asked for
    chunk_logits: torch.Tensor | None = None   # [length, V] with ``every_row``: row j predicts prompt token offset + j + 1
