"""Counts and orders in page text: "1 request", "2 requests", "every 3rd request" (issue 29, item 12)."""
from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an "s" unless it is one: "1 request", "605 requests"."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, 102nd."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
