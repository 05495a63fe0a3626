"""One request's grammar state: fill its token mask, advance on each sampled token, roll back.

Wraps an llguidance ``LLMatcher`` (a copy of the compiled template). With ``start_after``
set (the model's ``</think>`` id for a thinking reply) the grammar is dormant until that
token is generated: the thought is free text, the answer after it is constrained.

Every ``advance`` is logged as one entry (free text, the start token, or a token the
matcher consumed), so ``rollback(n)`` undoes exactly the last n tokens whatever they were.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.grammar.spec import GrammarSpec

_FREE, _START, _CONSUMED = 0, 1, 2


class GrammarState:
    def __init__(self, spec: GrammarSpec, matcher: Any, tokenizer: Any, *, start_after: int | None = None) -> None:
        self.spec = spec
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.start_after = start_after
        self.is_active = start_after is None
        self._log: list[int] = []
        self.failure: str | None = None     # set when the grammar can no longer produce a mask

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def num_mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    # ---- masks -----------------------------------------------------------------------
    def fill_mask(self, row: np.ndarray) -> bool:
        """Write the allowed-token bitmask into ``row`` ([W] int32, C-contiguous).

        Returns False (and records ``failure``) when nothing is allowed: the matcher is in an
        error state, which the mask should have made impossible; the caller leaves the row free
        and ``advance`` then ends the request with the error.
        """
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.matcher.is_error() or not row.any():
            self.failure = self.matcher.get_error() or "the grammar allows no token here"
            return False
        return True

    def allowed_mask(self) -> torch.Tensor | None:
        """[V] bool of the tokens allowed next, or None when the grammar does not constrain yet."""
        if not self.is_active:
            return None
        row = np.zeros((1, self.num_mask_words), dtype=np.int32)
        if not self.fill_mask(row[0]):
            return None
        return unpack_bits(row, self.vocab_size)[0]

    # ---- advancing -------------------------------------------------------------------
    def advance(self, token: int) -> bool:
        """Take the sampled token; False when the grammar rejects it (the request cannot go on)."""
        if not self.is_active:
            self._log.append(_START if token == self.start_after else _FREE)
            self.is_active = token == self.start_after
            return True
        if not self.matcher.consume_token(token):
            self.failure = self.matcher.get_error() or f"token {token} is not allowed by the grammar"
            return False
        self._log.append(_CONSUMED)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances (speculative tokens verification rejected)."""
        if not 0 <= num_tokens <= len(self._log):
            raise ValueError(f"rollback of {num_tokens} tokens, but {len(self._log)} were advanced")
        undone = [self._log.pop() for _ in range(num_tokens)]
        num_consumed = sum(1 for kind in undone if kind == _CONSUMED)
        if num_consumed and not self.matcher.rollback(num_consumed):
            raise RuntimeError(f"grammar rollback of {num_consumed} tokens failed: {self.matcher.get_error()}")
        if _START in undone:
            self.is_active = False

    def num_valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar would take in a row from here, without advancing."""
        if self.is_active:
            return self.matcher.validate_tokens(list(tokens))
        if self.start_after not in tokens:
            return len(tokens)
        cut = tokens.index(self.start_after) + 1
        rest = tokens[cut:]
        # The matcher has consumed nothing yet, so validating the rest from here is exact.
        return cut + (self.matcher.validate_tokens(rest) if rest else 0)

    # ---- where it stands ----------------------------------------------------------------
    @property
    def is_stopped(self) -> bool:
        """Complete: nothing but EOS may follow, so the request ends here (finish_reason stop)."""
        return self.is_active and self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return self.is_active and self.matcher.is_accepting() and not self.matcher.is_error()


def unpack_bits(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 llguidance bitmask (bit j of word w = token 32w + j) -> [R, vocab_size] bool.

    One ``np.unpackbits`` (little-endian words, little bit order): a handful of torch ops on a
    small vocabulary cost more than the mask itself.
    """
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), axis=1,
                         bitorder="little")                                    # [R, W * 32] uint8
    return torch.from_numpy(bits[:, :vocab_size]).bool()                       # [R, V]
