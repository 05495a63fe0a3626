"""Output tokens -> text deltas safe to send: never half a UTF-8 character, never a stop string.

The engine ends a request once its text contains a stop string (``outputs.py``); the text
a client sees stops before it (OpenAI's rule). While streaming, the tail that could still
become a stop string is held back until the next tokens decide it.

Decoding is incremental, as vLLM and transformers' streamers do it: each push decodes only
the tokens since the last complete character, with a few tokens before them as context (a
tokenizer may render a token differently at the start of a text), so a reply of n tokens
costs O(n) decoding, not O(n^2).
"""
from __future__ import annotations

from collections.abc import Callable

from engine.scheduler.request_features import find_stop_string

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
        self._done = ""        # the text of tokens[:_read], which ends on a complete character
        self._prefix = 0       # tokens[_prefix:_read] is the decoding context of what follows
        self._read = 0

    def _text(self) -> str:
        """The text of every token so far (an unfinished character shows as REPLACEMENT)."""
        if self._read == len(self.tokens):
            return self._done
        context = self._detokenize(self.tokens[self._prefix:self._read])
        tail = self._detokenize(self.tokens[self._prefix:])
        new = tail[len(context):]
        if new and not new.endswith(REPLACEMENT) and tail.startswith(context):
            self._done += new                       # complete: the context moves up
            self._prefix, self._read = self._read, len(self.tokens)
            return self._done
        return self._done + new

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
