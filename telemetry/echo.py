"""A message that quotes what the user typed, cut to a readable length for the page and the terminal.

A 10 kB invalid lever value came back whole in its error ("lever x: '9999…' is not an integer") and
pushed every lever below the fold (issue 29, item 7). ``cut_echo`` shows a word of a message over
``MAX_WORD`` characters as its first ``HEAD`` and its length, and keeps the whole message up to
``MAX_CHARS``, so the reason after the quoted value ("is not an integer") stays in view.
"""
from __future__ import annotations

import re

MAX_WORD = 160        # a word (a quoted value) longer than this is shown as its head and its length; a path fits
MAX_CHARS = 400       # the whole message (a value of many short words)
HEAD = 32             # what is kept of a cut word
_LONG_WORD = re.compile(r"\S{%d,}" % (MAX_WORD + 1))
_QUOTED = re.compile(r"(['\"]?)(.*?)\1([,.;:)]*)", re.S)


def cut_word(word: str) -> str:
    """The word's head and its length; a quoted value keeps its quotes, its length counts what is inside."""
    quote, inner, tail = _QUOTED.fullmatch(word).groups()
    return f"{quote}{inner[:HEAD]}…{quote} ({len(inner):,} characters){tail}"


def cut_echo(message: str) -> str:
    """``message`` with every word over ``MAX_WORD`` characters cut, and at most ``MAX_CHARS`` long."""
    text = _LONG_WORD.sub(lambda m: cut_word(m.group(0)), message)
    if len(text) > MAX_CHARS:
        suffix = f"… ({len(message):,} characters in all)"
        text = text[:MAX_CHARS - len(suffix)] + suffix
    return text
