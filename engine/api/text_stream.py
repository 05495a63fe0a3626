"""Output tokens -> text deltas safe to send: never half a UTF-8 character, never a stop string.

The engine ends a request once its text contains a stop string (``outputs.py``); the text
a client sees stops before it (OpenAI's rule). While streaming, the tail that could still
become a stop string is held back until the next tokens decide it.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.request_features import find_stop_string

REPLACEMENT = "\ufffd"   # what a decoder gives for an incomplete UTF-8 sequence


class TextStream:
    def __init__(self, detokenize: Callable[[list[int]], str], stop_strings: tuple[str, ...] = (),
                 hidden_ids: frozenset[int] = frozenset()) -> None:
        self._detokenize = detokenize
        self._hidden = hidden_ids   # EOS and stop ids: they end the output but are not its text
        self._stops = stop_strings
        self._holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0          # characters already handed out

    def _text(self) -> str:
        return self._detokenize(self.tokens)

    def push(self, tokens: list[int]) -> str:
        """Add tokens; returns the new text that is certain (may be empty)."""
        self.tokens.extend(t for t in tokens if t not in self._hidden)
        text = self._text()
        cut = find_stop_string(text, self._stops)
        if cut is not None:
            safe = cut
        else:
            safe = len(text) - self._holdback if self._stops else len(text)
            while safe > self.sent and text[safe - 1] == REPLACEMENT:   # an unfinished character
                safe -= 1
        return self._take(text, safe)

    def finish(self) -> str:
        """The rest of the text at the end of the request (cut before any stop string)."""
        text = self._text()
        cut = find_stop_string(text, self._stops)
        return self._take(text, len(text) if cut is None else cut)

    def _take(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent:upto], upto
        return delta

    def full_text(self) -> str:
        text = self._text()
        cut = find_stop_string(text, self._stops)
        return text if cut is None else text[:cut]
