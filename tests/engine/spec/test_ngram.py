"""Prompt-lookup drafts: the longest recurring suffix, its most recent earlier match, its followers."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.spec.ngram import propose_drafts


@pytest.mark.parametrize("tokens, kwargs, expected", [
    ([], {}, []),
    ([7], {}, []),
    ([1, 2, 3, 4], {}, []),                                   # nothing recurs
    ([1, 2, 3, 9, 1, 2, 3], {}, [9, 1, 2, 3]),                # trigram match, continued periodically
    ([1, 2, 3, 9, 8, 1, 2, 3], {"num_drafts": 2}, [9, 8]),    # capped at num_drafts
    ([5, 1, 2, 6, 7, 1, 2], {}, [6, 7, 1, 2]),                # bigram when no trigram recurs
    ([4, 2, 8, 3, 2], {}, [8, 3, 2, 8]),                      # unigram fallback, period 3
    ([4, 2, 8, 3, 2], {"min_ngram": 2}, []),                  # ... unless min_ngram forbids it
    # most recent occurrence wins among equal n: "1 2" was followed by 3, later by 4
    ([1, 2, 3, 0, 1, 2, 4, 0, 1, 2], {}, [4, 0, 1, 2]),
    # a longer match beats a more recent shorter one
    ([9, 1, 2, 5, 0, 2, 6, 9, 1, 2], {}, [5, 0, 2, 6]),
    ([3, 3, 3, 3], {}, [3, 3, 3, 3]),                         # a run continues as a run
    ([1, 2, 1, 2, 1, 2], {}, [1, 2, 1, 2]),                   # a period-2 loop keeps looping
    ([1, 2, 3, 1, 2, 3], {"max_ngram": 1}, [1, 2, 3, 1]),     # unigram only: last 3 -> after index 2
    ([6, 1, 2, 3, 6, 1, 9, 9, 9, 6, 1], {}, [9, 9, 9, 6]),    # the most recent bigram match wins
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], {"num_drafts": 6}, [4, 5, 6, 1, 2, 3]),
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
    # The proposal continues the sequence as if it repeated from the match on:
    # draft j is the token (length - start - n) positions before it.
    period = len(tokens) - start - n
    out = []
    for j in range(num_drafts):
        ext = tokens + out
        out.append(ext[len(ext) - period])
    return out


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
        # Appending the drafts keeps the last min_ngram tokens a repeat of an earlier spot:
        # the drafted continuation is the text that followed such a spot.
        ext = tokens + drafts
        assert any(ext[s:s + min_ngram] == tokens[-min_ngram:]
                   and ext[s + min_ngram:s + min_ngram + len(drafts)] == drafts
                   for s in range(len(tokens) - min_ngram))


def test_the_ngram_min_match_lever_sets_the_shortest_suffix_the_drafter_matches():
    from engine.spec.drafts import propose
    from telemetry.levers import LeversError, defaults
    one_token_match = [5, 9, 7, 1, 2, 3, 9]          # only "9" recurs: a 1-token match
    three_token_match = [4, 5, 6, 8, 1, 4, 5, 6]      # "4 5 6" recurs
    assert propose("ngram", None, None, one_token_match, 2) == [7, 1]   # the lever's default, 1
    assert propose("ngram", None, None, one_token_match, 2, ngram_min_match=2) == []
    assert propose("ngram", None, None, three_token_match, 2, ngram_min_match=3) == [8, 1]
    assert defaults().ngram_min_match == 1 and defaults().replace(ngram_min_match=3).ngram_min_match == 3
    with pytest.raises(LeversError):
        defaults().replace(ngram_min_match=4)   # longer than the 3-token suffix lookup starts from
