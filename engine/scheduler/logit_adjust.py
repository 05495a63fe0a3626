"""Logit bias and repetition penalties, as OpenAI and vLLM define them: pure tensor functions.

Applied to every row (greedy ones too) after the min-tokens bans and the grammar mask, before
temperature and the filters, in vLLM's order:

- ``logit_bias``: each listed token id's logit gets its bias added (OpenAI: -100 bans it,
  +100 all but forces it);
- ``repetition_penalty`` (vLLM's, over prompt and output tokens): a seen token's logit is
  divided by the penalty when positive, multiplied by it when not;
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI's, over the generated tokens only):
  ``logit -= frequency * count + presence * (count > 0)``.

A masked (-inf) logit stays -inf whatever is added, so a bias never revives a token the
grammar or the min-tokens rule banned.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_BIAS = 100.0          # OpenAI's bound on a logit_bias value
MAX_PENALTY = 2.0         # OpenAI's bound on frequency / presence penalties (either sign)


def needs_adjusting(params) -> bool:
    """Does this row's SamplingParams ask for any bias or penalty? (``SamplingParams.adjusts_logits``
    keeps the answer.)"""
    return bool(params.logit_bias) or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 \
        or params.repetition_penalty != 1.0


def adjust_row(row: torch.Tensor,                      # [V], modified in place
               params, output_tokens: Sequence[int], prompt_tokens: Sequence[int]) -> None:
    """Apply ``params``' bias and penalties to one logits row, in place."""
    vocab = row.shape[0]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=row.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, bias)
    if params.repetition_penalty != 1.0 and (prompt_tokens or output_tokens):
        seen = torch.tensor(sorted(set(prompt_tokens) | set(output_tokens)), dtype=torch.long, device=row.device)
        seen = seen[seen < vocab]
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output_tokens:
        counts = torch.bincount(torch.tensor(list(output_tokens), dtype=torch.long, device=row.device),
                                minlength=vocab)[:vocab].to(row.dtype)                  # [V]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def adjust(logits: torch.Tensor,                       # [B, V], modified in place
           params: Sequence, output_tokens: Sequence[Sequence[int]] | None,
           prompt_tokens: Sequence[Sequence[int]] | None) -> None:
    """Every row that asks for a bias or a penalty gets it (rows that do not are left alone)."""
    for i, p in enumerate(params):
        if p.adjusts_logits:
            adjust_row(logits[i], p, output_tokens[i] if output_tokens is not None else (),
                       prompt_tokens[i] if prompt_tokens is not None else ())


def check(params, vocab_size: int) -> None:
    """ValueError naming the first bad bias or penalty field (ranges as OpenAI / vLLM check them)."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"sampling.{name} must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
    r = params.repetition_penalty
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 < r < float("inf"):
        raise ValueError(f"sampling.repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
    for entry in params.logit_bias:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ValueError(f"sampling.logit_bias entries must be [token_id, bias] pairs, got {entry!r}")
        token, bias = entry
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"sampling.logit_bias: token id {token!r} is outside the vocabulary [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValueError(f"sampling.logit_bias[{token}] must be a number in [-{MAX_BIAS}, {MAX_BIAS}], got {bias!r}")
