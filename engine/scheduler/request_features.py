"""What a request asks of the engine beyond sampling: where it came from, its first-token
rules (thinking, a required tool call), stop strings, logprobs (of its output and of its
prompt) and, for one of n choices of one API request, which one it is.

The features travel with the request (``Scheduler.submit``), are stored in its ``requests``
row and in ``workload.jsonl``, so a replay reproduces them. Pure Python: workloads,
the API and the scheduler share it without torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.scheduler.json_fields import strict_kwargs

SOURCE_WORKLOAD = "workload"
SOURCE_API = "api"
SOURCE_REPLAY = "replay"   # a recorded run's workload served again (serve --workload bundle:PATH)
SOURCES = (SOURCE_WORKLOAD, SOURCE_API, SOURCE_REPLAY)
MAX_LOGPROBS = 20          # top-k alternatives per token (OpenAI's bound for chat top_logprobs)
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16           # n: sibling requests of one API request
CLIENT_DISCONNECTED = "client disconnected"   # the cancel reason of an API client that went away


@dataclass(frozen=True)
class RequestFeatures:
    source: str = SOURCE_WORKLOAD
    enable_thinking: bool = False        # the reply opens inside a think block (first-token rule)
    require_tool_call: bool = False      # tool_choice required / named: token 0 is the tool-call start
    stop_strings: tuple[str, ...] = ()   # the output ends (reason "stop") once one appears in its text
    logprobs: int | None = None          # None: none; k >= 0: the chosen token's logprob + top k
    prompt_logprobs: int | None = None   # None: none; k >= 0: each prompt token's logprob + top k (echo)
    n: int = 1                           # the API request's choices: this request is one of n siblings
    choice: int = 0                      # which one (0 .. n - 1); siblings share the prompt
    images: tuple[str, ...] = ()         # the prompt's images in order, by content hash (engine/multimodal/)

    def validate(self) -> "RequestFeatures":
        """Raise ValueError naming the first bad field; return self when all are fine."""
        if self.source not in SOURCES:
            raise ValueError(f"features.source must be one of {SOURCES}, got {self.source!r}")
        for name in ("enable_thinking", "require_tool_call"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"features.{name} must be a bool, got {getattr(self, name)!r}")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"features.stop_strings: at most {MAX_STOP_STRINGS}, got {len(self.stop_strings)}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"features.stop_strings must be non-empty strings, got {list(self.stop_strings)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"features.{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {k!r}")
        n, choice = self.n, self.choice
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"features.n must be an int in [1, {MAX_CHOICES}], got {n!r}")
        if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < n:
            raise ValueError(f"features.choice must be an int in [0, n={n}), got {choice!r}")
        if any(not isinstance(h, str) or len(h) != 64 or h.strip("0123456789abcdef") for h in self.images):
            raise ValueError(f"features.images must be sha256 hex digests, got {list(self.images)!r:.120}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """As stored; prompt logprobs and the choice fields only when set (rows of requests without
        them read as before those fields existed)."""
        d = asdict(self)
        d["stop_strings"] = list(self.stop_strings)
        d["images"] = list(self.images)
        for name, off in (("prompt_logprobs", None), ("n", 1), ("choice", 0), ("images", [])):
            if d[name] == off:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "RequestFeatures":
        """From a stored dict (a request row, a workload.jsonl line); unknown keys are an error."""
        if data is None:
            return cls()
        kwargs = strict_kwargs(cls, data, "features", "stop_strings", "strings")
        if "images" in kwargs:
            if not isinstance(kwargs["images"], (list, tuple)):
                raise ValueError(f"features.images must be a list of content hashes, got {kwargs['images']!r}")
            kwargs["images"] = tuple(kwargs["images"])
        return cls(**kwargs).validate()


def stop_string_window(stop_strings: tuple[str, ...]) -> int:
    """How many trailing tokens can hold a just-completed stop string: a char is at most
    4 bytes, and a byte-level token carries at least one byte (longer tokens need fewer)."""
    return 4 * max((len(s) for s in stop_strings), default=0) + 1


def find_stop_string(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None
