"""One lever's definition: its type, default, bounds or choices, and how a value is checked and parsed.

The registry of levers and the levers file live in ``telemetry.levers``; this module holds the
rule every value passes, wherever it comes from (environment, file, dashboard, command line).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "CHUNKSCOPE_"
MAX_INT_DIGITS = 19           # every bound fits in 2**63 - 1; longer text is out of range before int() sees it


class LeversError(ValueError):
    """A lever value, environment variable or levers file was rejected (one-line message)."""


@dataclass(frozen=True)
class Lever:
    name: str
    type: type                                  # bool, int or str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None      # for str levers
    bounds: tuple[int, int] | None = None       # inclusive, for int levers

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def check(self, value: Any) -> Any:
        """Return ``value`` if it is valid for this lever, else raise LeversError."""
        # bool is a subclass of int: an int lever must not take true/false, nor vice versa.
        if type(value) is not self.type:
            raise LeversError(f"lever {self.name}: expected {self.type.__name__}, "
                              f"got {type(value).__name__} {value!r}")
        if self.bounds is not None and not self.bounds[0] <= value <= self.bounds[1]:
            raise LeversError(f"lever {self.name}: {value} is outside [{self.bounds[0]}, {self.bounds[1]}]")
        if self.choices is not None and value not in self.choices:
            raise LeversError(f"lever {self.name}: {value!r} is not one of {', '.join(self.choices)}")
        return value

    def parse_text(self, text: str) -> Any:
        """Parse an environment / command-line string into a checked value."""
        raw = text.strip()
        if self.type is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise LeversError(f"lever {self.name}: {text!r} is not a boolean (use 1/0, true/false)")
        if self.type is int:
            # int() also takes '٣٢', '３２' and '1_000'; a lever value is plain ASCII digits
            if not re.fullmatch(r"[+-]?[0-9]+", raw):
                raise LeversError(f"lever {self.name}: {text!r} is not an integer (ASCII digits 0-9 only, "
                                  f"no '_' or ',')")
            if len(raw.lstrip("+-").lstrip("0")) > MAX_INT_DIGITS:   # int() of 5,000 digits raises
                raise LeversError(f"lever {self.name}: a {len(raw):,}-digit value is outside "
                                  f"[{self.bounds[0]}, {self.bounds[1]}]" if self.bounds else
                                  f"lever {self.name}: a {len(raw):,}-digit value is too large")
            try:
                return self.check(int(raw, 10))
            except ValueError as exc:
                if isinstance(exc, LeversError):
                    raise
                raise LeversError(f"lever {self.name}: {text!r} is not an integer") from None
        return self.check(raw)

    def describe_range(self) -> str:
        if self.choices is not None:
            return " / ".join(self.choices)
        if self.bounds is not None:
            return f"{self.bounds[0]}..{self.bounds[1]}"
        return "true / false"
