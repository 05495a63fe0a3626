"""Next-token sampling: per-request parameters and one batched draw.

Order of operations for every row (the reference's, and the usual one):
suppress EOS / stop tokens while ``min_tokens`` is not reached, then greedy
rows take the argmax; sampled rows go through temperature, top-k, top-p and
min-p filtering and draw from their own ``torch.Generator``.

Why one generator per row: a request with a seed must replay exactly, no
matter which other requests share its batch or at which row it sits. Each
row's draw consumes only its own generator, and the filtering is row-wise,
so neither batch size nor row order can change a seeded request's tokens.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Sequence

import torch

SPECULATION_MTP = "mtp"


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler. ``top_k=0`` and ``top_p=1`` mean "off"."""

    temperature: float = 0.0            # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0                 # EOS / stop ids are banned until this many tokens exist
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> "SamplingParams":
        """Raise ValueError naming the first bad field; return self when all are fine."""
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"sampling.temperature must be a number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if not isinstance(m, (int, float)) or math.isnan(m) or not 0.0 <= m <= 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1], got {m!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"sampling.min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"sampling.seed must be an int or None, got {self.seed!r}")
        bad = [s for s in self.stop_token_ids if not isinstance(s, int) or not 0 <= s < vocab_size]
        if bad:
            raise ValueError(
                f"sampling.stop_token_ids must lie in [0, {vocab_size}), got out-of-range {bad}")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are an error (typos must not pass silently)."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {unknown}; known: {sorted(known)}")
        kwargs = dict(data)
        if "stop_token_ids" in kwargs:
            stops = kwargs["stop_token_ids"]
            if not isinstance(stops, (list, tuple)):
                raise ValueError(f"sampling.stop_token_ids must be a list of ints, got {stops!r}")
            kwargs["stop_token_ids"] = tuple(stops)
        return cls(**kwargs)


def effective_min_p(params: SamplingParams, speculation: str, no_mtp_minp: bool) -> float:
    """The min-p actually applied: 0.0 under MTP speculation when the ``no_mtp_minp`` lever is on."""
    if no_mtp_minp and speculation == SPECULATION_MTP:
        return 0.0
    return params.min_p


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None (use the global RNG) when it has no seed."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def suppress_tokens(logits: torch.Tensor, banned_per_row: Sequence[Iterable[int]]) -> torch.Tensor:
    """Return a copy of ``logits`` [B, V] with each row's banned ids set to -inf."""
    out = logits.clone()
    for row, banned in enumerate(banned_per_row):
        ids = sorted(set(banned))
        if ids:
            out[row, ids] = float("-inf")
    return out


def filtered_probs(
    logits: torch.Tensor,          # [B, V], already suppressed
    temperature: torch.Tensor,     # [B] > 0
    top_k: torch.Tensor,           # [B] long, 0 = off
    top_p: torch.Tensor,           # [B]
    min_p: torch.Tensor,           # [B]
) -> torch.Tensor:                 # [B, V] probabilities, zero outside the kept set
    """Temperature, then top-k, top-p and min-p, vectorized over rows with their own values."""
    num_rows, vocab = logits.shape
    scaled = logits.float() / temperature.float().unsqueeze(1)              # [B, V]
    # A stable descending sort gives every row the same ranks however the batch is built.
    sorted_logits, order = torch.sort(scaled, dim=1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)           # [1, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    keep = rank < k.unsqueeze(1)                                            # [B, V]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=1)                             # [B, V]
    # Top-p keeps the shortest head whose mass reaches top_p: a token stays while
    # the mass *before* it is still short of top_p, so the best token always stays.
    mass_before = torch.cumsum(probs, dim=1) - probs
    keep &= mass_before < top_p.float().unsqueeze(1)
    # Min-p is relative to the best token, so renormalizing after top-k/top-p
    # would not move it; compare against the current probabilities directly.
    best = probs[:, :1]                                                     # [B, 1]
    keep &= probs >= min_p.float().unsqueeze(1) * best
    keep[:, 0] = True  # never an empty set, even with min_p == 1 and float round-off
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=1)
    return torch.zeros_like(probs).scatter_(1, order, probs)                # back to vocab order


def _draw(probs_row: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution, on the generator's device so its stream is the only input."""
    if generator is not None and probs_row.device != generator.device:
        probs_row = probs_row.to(generator.device)
    return int(torch.multinomial(probs_row, 1, generator=generator).item())


def sample_next(
    logits: torch.Tensor,                      # [B, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    num_generated: Sequence[int],
    eos_token_ids: set[int],
    min_p_override: Sequence[float | None] | None = None,
) -> torch.Tensor:                             # [B] long
    """Pick each row's next token. ``min_p_override[i]`` (when not None) replaces row i's min-p."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    for name, seq in (("params", params), ("generators", generators), ("num_generated", num_generated)):
        if len(seq) != num_rows:
            raise ValueError(f"{name} has {len(seq)} entries for {num_rows} logits rows")
    if min_p_override is not None and len(min_p_override) != num_rows:
        raise ValueError(f"min_p_override has {len(min_p_override)} entries for {num_rows} logits rows")

    banned = [
        (set(eos_token_ids) | set(p.stop_token_ids)) if n < p.min_tokens else ()
        for p, n in zip(params, num_generated)
    ]
    logits = suppress_tokens(logits, banned)                                # [B, V]
    next_tokens = torch.argmax(logits, dim=1)                               # [B] greedy answer
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled_rows:
        return next_tokens

    dev = logits.device
    rows = torch.tensor(sampled_rows, device=dev)
    min_ps = [
        params[i].min_p if min_p_override is None or min_p_override[i] is None else min_p_override[i]
        for i in sampled_rows
    ]
    probs = filtered_probs(
        logits[rows],
        torch.tensor([params[i].temperature for i in sampled_rows], device=dev),
        torch.tensor([params[i].top_k for i in sampled_rows], device=dev, dtype=torch.long),
        torch.tensor([params[i].top_p for i in sampled_rows], device=dev),
        torch.tensor(min_ps, device=dev),
    )                                                                       # [S, V]
    for j, i in enumerate(sampled_rows):
        next_tokens[i] = _draw(probs[j], generators[i])
    return next_tokens
