"""Prompt-lookup drafts: guess the next tokens by finding the current suffix earlier in the sequence.

Pure decision code on token lists (no torch). The ``ngram`` speculation kind
drafts with it: a sequence that repeats itself (code, quoted text, a list,
a looping model) gets its continuation for the price of one verify forward.
"""
from __future__ import annotations

from typing import Sequence


def propose_drafts(tokens: Sequence[int], *, max_ngram: int = 3, min_ngram: int = 1,
                   num_drafts: int = 4) -> list[int]:
    """Up to ``num_drafts`` tokens that followed the most recent earlier match of the suffix.

    For n from ``max_ngram`` down to ``min_ngram``: take the last n tokens, find
    their most recent earlier occurrence (one that ends before the suffix starts
    ending, i.e. not the suffix itself) and return the tokens that followed it.
    The longest n with a match wins, since a longer match is a stronger
    prediction; the most recent occurrence wins among equals, since nearby text
    predicts best. A match may overlap the suffix; then the followers run into
    the drafts themselves, i.e. the repeat is continued with its own period
    (``1 2 1 2 1 2`` drafts ``1 2 1 2``, a run ``a a a`` drafts more ``a``),
    which is what a looping sequence does next. Returns [] when no n-gram of
    those lengths recurs.
    """
    if min_ngram < 1:
        raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
    if max_ngram < min_ngram:
        raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
    if num_drafts < 0:
        raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
    tokens = list(tokens)
    length = len(tokens)
    if num_drafts == 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n:]
        # Candidate starts, newest first; start + n < length keeps at least one follower.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                # Copy forward from just after the match; reading past the end reads the
                # drafts already copied, which repeats the period (length - follow) as needed.
                extended = list(tokens)
                follow = start + n
                while len(extended) - length < num_drafts:
                    extended.append(extended[follow])
                    follow += 1
                return extended[length:]
    return []
