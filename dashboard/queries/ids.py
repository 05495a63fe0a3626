"""What a user types into an id box (Chunks' request id, Requests' search, a link's ``?request=``).

One grammar everywhere: ids and inclusive ranges separated by commas or spaces (``12``, ``3, 7``,
``10-20``, ``3, 10-20``), where an id is ASCII digits or the id the OpenAI-compatible API returned
(``chatcmpl-<hex>-<request id>``: the engine's request id is its suffix, see
``engine/api/choices.py``). Anything else is a ``BadSearch`` with a one-line message that quotes at
most ``MAX_ECHO`` characters of what was typed; no length of digits reaches ``int()`` unchecked
(Python refuses to convert more than 4,300 digits, SQLite binds at most 2**63 - 1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_REQUEST_ID = 2**63 - 1        # SQLite's INTEGER: a larger id cannot exist and cannot be bound
MAX_DIGITS = len(str(MAX_REQUEST_ID))
MAX_ECHO = 24                     # characters of the typed text a message repeats
API_ID = re.compile(r"(?:chatcmpl|cmpl)-[0-9a-zA-Z]+(?:-([0-9]+))?")
RANGE = re.compile(r"([0-9]+)-([0-9]+)")
FORMS = "type an id (12), ids (3, 7), a range (10-20) or an API id (chatcmpl-…-12)"


class BadSearch(ValueError):
    """The typed text is not an id, a list of ids or a range."""


def echo(text: str) -> str:
    """``text`` quoted for a message, cut to ``MAX_ECHO`` characters with its length said."""
    if len(text) <= MAX_ECHO:
        return repr(text)
    return f"{text[:MAX_ECHO]!r}… ({len(text):,} characters)"


def parse_request_id(text: str, what: str = "request id") -> int:
    """One id: ASCII digits within SQLite's range, or an API id carrying the engine's request id."""
    text = text.strip()
    api = API_ID.fullmatch(text)
    if api:
        if api[1] is None:
            raise BadSearch(f"{what} {echo(text)} carries no engine request id (this engine's API ids end "
                            f"in -<request id>, and each response has an x-chunkscope-request-ids header)")
        text = api[1]
    if not re.fullmatch(r"[0-9]+", text):
        raise BadSearch(f"{what} {echo(text)} is not a number (type digits 0-9)")
    if len(text.lstrip("0")) > MAX_DIGITS or int(text) > MAX_REQUEST_ID:   # length first: int() of 5,000 digits raises
        raise BadSearch(f"{what} {echo(text)} is too large (request ids are at most {MAX_REQUEST_ID})")
    return int(text)


@dataclass(frozen=True)
class IdSelection:
    """Request ids and inclusive id ranges; a row matches when it is in either."""

    ids: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()

    def where(self, column: str = "request_id") -> tuple[str, list[int]]:
        """A parameterized SQL condition on ``column`` (values bound, never formatted in)."""
        parts, params = [], []
        if self.ids:
            parts.append(f"{column} IN ({', '.join('?' * len(self.ids))})")
            params += list(self.ids)
        for lo, hi in self.ranges:
            parts.append(f"{column} BETWEEN ? AND ?")
            params += [lo, hi]
        return "(" + " OR ".join(parts) + ")", params

    def describe(self) -> str:
        return ", ".join([str(i) for i in self.ids] + [f"{lo}-{hi}" for lo, hi in self.ranges])


def parse_ids(text: str | None) -> IdSelection | None:
    """``""`` -> None (no filter); ``"12"``, ``"3, 7"``, ``"10-20"``, ``"chatcmpl-…-12"`` and mixes of them."""
    text = (text or "").strip()
    if not text:
        return None
    ids, ranges = [], []
    # A range may have spaces around its dash: join "10 - 20" before splitting on commas and spaces.
    for part in re.split(r"[,\s]+", re.sub(r"\s*-\s*(?=[0-9])", "-", text)):
        if not part:
            continue
        whole = RANGE.fullmatch(part)
        if whole:
            lo, hi = parse_request_id(whole[1], "range start"), parse_request_id(whole[2], "range end")
            if lo > hi:
                raise BadSearch(f"range {echo(part)}: start {lo} is after end {hi}")
            ranges.append((lo, hi))
        elif API_ID.fullmatch(part) or re.fullmatch(r"[0-9]+", part):
            ids.append(parse_request_id(part))
        else:
            raise BadSearch(f"{echo(part)} is not an id: {FORMS}")
    return IdSelection(tuple(dict.fromkeys(ids)), tuple(dict.fromkeys(ranges)))
