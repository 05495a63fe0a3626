"""Slips: a thought with a word of a known kind swapped for another, the swap left out of the loss.

A thought restates the question (a name, a city, the words to repeat, a number) and names what it
picks (list items, a tool, a score) before it closes with ``</think>``; any of those words (a
listed name, city, topic, weather, thing or tool name, or a number) may be the slipped one. Sampled at temperature 0.7, tiny-chat sometimes copies one of those words
wrong, and a model that had only ever seen perfect thoughts then wandered: it kept listing
words, or ended the turn inside the thought. Training on thoughts with a slip in them, the slip
itself untrained, teaches what to do after one (copy from the question again, finish the thought,
close it) without ever teaching the slip.

Pure Python, deterministic for a ``random.Random``.
"""
from __future__ import annotations

import random
import re

from engine.train.tasks import CITIES, NAMES, THINGS, TOOL_BY_NAME, TOPICS, WEATHER

SLIP_SHARE = 0.3   # share of thinking examples whose thought carries slips
MAX_SLIPS = 2      # slips in one such thought: 1 .. this many

# Words a thought copies, by kind: a slip swaps a word for another of its kind.
POOLS: tuple[tuple[str, ...], ...] = (
    NAMES, CITIES, TOPICS, WEATHER, tuple(sorted(THINGS)), tuple(sorted(TOOL_BY_NAME)),
    tuple(sorted({item for items in THINGS.values() for item in items})),
)
_POOL_OF = {word: pool for pool in POOLS for word in pool}
_WORD = re.compile(r"\b(" + "|".join(sorted(map(re.escape, _POOL_OF), key=len, reverse=True)) + r"|\d+)\b")


def _swap(rng: random.Random, word: str) -> str:
    if word.isdigit():
        other = str(rng.randint(0, 10 ** len(word) - 1))
        return other if other != word else str(int(word) + 1)
    return rng.choice([w for w in _POOL_OF[word] if w != word])


def with_slip(rng: random.Random, thought: str) -> list[tuple[str, bool]]:
    """``thought`` as (text, trained) segments with 1 .. MAX_SLIPS of its known-kind words swapped and untrained;
    a thought that copies nothing comes back whole."""
    matches = list(_WORD.finditer(thought))
    if not matches:
        return [(thought, True)]
    chosen = sorted(rng.sample(matches, min(len(matches), rng.randint(1, MAX_SLIPS))), key=lambda m: m.start())
    segments, at = [], 0
    for match in chosen:
        segments += [(thought[at:match.start()], True), (_swap(rng, match.group()), False)]
        at = match.end()
    segments.append((thought[at:], True))
    return [(text, trained) for text, trained in segments if text]
