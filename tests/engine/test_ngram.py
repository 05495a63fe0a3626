"""Prompt-lookup drafts: the longest recurring suffix, its most recent earlier match, its followers."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.scheduler.ngram import propose_drafts


@pytest.mark.parametrize("tokens, kwargs, expected", [
    ([], {}, []),
    ([7], {}, []),
    ([1, 2, 3, 4], {}, []),                                   # nothing recurs
    ([1, 2, 3, 9, 1, 2, 3], {}, [9, 1, 2, 3]),                # trigram match, 4 followers
    ([1, 2, 3, 9, 8, 1, 2, 3], {"num_drafts": 2}, [9, 8]),    # capped at num_drafts
    ([5, 1, 2, 6, 7, 1, 2], {}, [6, 7, 1, 2]),                # bigram when no trigram recurs
    ([4, 2, 8, 3, 2], {}, [8, 3, 2]),                         # unigram fallback
    ([4, 2, 8, 3, 2], {"min_ngram": 2}, []),                  # ... unless min_ngram forbids it
    # most recent occurrence wins among equal n: "1 2" was followed by 3, later by 4
    ([1, 2, 3, 0, 1, 2, 4, 0, 1, 2], {}, [4, 0, 1, 2]),
    # a longer match beats a more recent shorter one
    ([9, 1, 2, 5, 0, 2, 6, 9, 1, 2], {}, [5, 0, 2, 6]),
    ([3, 3, 3, 3], {}, [3]),                                  # overlapping match inside a run
    ([1, 2, 1, 2, 1, 2], {}, [1, 2]),                         # period-2 loop: as far as it has seen
    ([1, 2, 3, 1, 2, 3], {"max_ngram": 1}, [1, 2, 3]),        # unigram only: last 3 -> follows index 2
    ([1, 2, 3, 1], {"num_drafts": 0}, []),
])
def test_table(tokens, kwargs, expected):
    assert propose_drafts(tokens, **kwargs) == expected


@pytest.mark.parametrize("kwargs, field", [
    ({"min_ngram": 0}, "min_ngram"),
    ({"max_ngram": 1, "min_ngram": 2}, "max_ngram"),
    ({"num_drafts": -1}, "num_drafts"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        propose_drafts([1, 2, 1], **kwargs)


def _reference(tokens, max_ngram, min_ngram, num_drafts):
    """Brute force over all (n, start) pairs: longest n first, then the latest start."""
    best = None
    for n in range(min_ngram, max_ngram + 1):
        if n >= len(tokens):
            break
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[-n:]:
                key = (n, start)
                if best is None or key > best:
                    best = key
    if best is None or num_drafts == 0:
        return []
    n, start = best
    return tokens[start + n:start + n + num_drafts]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), max_ngram=st.integers(1, 4),
       min_ngram=st.integers(1, 4), num_drafts=st.integers(0, 6))
def test_matches_brute_force_and_invariants(tokens, max_ngram, min_ngram, num_drafts):
    if max_ngram < min_ngram:
        max_ngram, min_ngram = min_ngram, max_ngram
    drafts = propose_drafts(tokens, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=num_drafts)
    assert drafts == _reference(tokens, max_ngram, min_ngram, num_drafts)
    assert len(drafts) <= num_drafts
    if drafts:
        # The drafts continue some earlier occurrence of a suffix of length >= min_ngram.
        text = tokens
        assert any(text[s:s + min_ngram] == text[-min_ngram:]
                   and text[s + min_ngram:s + min_ngram + len(drafts)] == drafts
                   for s in range(len(text) - min_ngram))
