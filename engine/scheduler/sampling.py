"""Next-token sampling: per-request parameters and one batched draw.

Order of operations for every row (the reference's, and the usual one):
suppress EOS / stop tokens while ``min_tokens`` is not reached, add the logit
bias and the repetition penalties (``logit_adjust.py``), then greedy rows take
the argmax; sampled rows go through temperature, top-k, top-p and min-p
filtering and draw from their own ``torch.Generator``.

Why one generator per row: a request with a seed must replay exactly, no
matter which other requests share its batch or at which row it sits. Each
row's draw consumes only its own generator, and the filtering is row-wise,
so neither batch size nor row order can change a seeded request's tokens.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import torch

from engine.scheduler import logit_adjust
from engine.scheduler.json_fields import strict_kwargs
from engine.spec.kinds import SPEC_MTP, is_speculative


_ADJUSTMENTS_OFF = {"logit_bias": [], "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


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
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, by id
    presence_penalty: float = 0.0       # over the generated tokens (OpenAI's)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0     # over prompt and generated tokens (vLLM's); 1 = off

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """A logit bias or a penalty to apply (worked out once: the tick asks for every row)."""
        return logit_adjust.needs_adjusting(self)

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
        logit_adjust.check(self, vocab_size)
        return self

    def to_dict(self) -> dict[str, Any]:
        """As stored (the request row, workload.jsonl); the bias and penalties only when set, so the
        rows of requests without them read as they did before those fields existed."""
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        for name, off in _ADJUSTMENTS_OFF.items():
            if d[name] == off:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are an error (typos must not pass silently)."""
        kwargs = strict_kwargs(cls, data, "sampling", "stop_token_ids", "ints")
        bias = kwargs.get("logit_bias", ())
        if not isinstance(bias, (list, tuple)):
            raise ValueError(f"sampling.logit_bias must be a list of [token_id, bias] pairs, got {bias!r}")
        kwargs["logit_bias"] = tuple(tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in bias)
        return cls(**kwargs)


def effective_min_p(params: SamplingParams, speculation: str, no_mtp_minp: bool) -> float:
    """The min-p actually applied: 0.0 under MTP speculation when the ``no_mtp_minp`` lever is on."""
    if is_speculative(speculation) and no_mtp_minp and speculation == SPEC_MTP:
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


# Sampled rows look at a sorted head of this many tokens when the head provably
# holds every token the filters keep; a full-vocabulary sort is ~50x slower.
HEAD_SIZE = 1024


def _filter_sorted(
    sorted_logits: torch.Tensor,   # [S, N] descending, temperature applied
    top_k: torch.Tensor,           # [S] long, 0 = off
    top_p: torch.Tensor,           # [S]
    min_p: torch.Tensor,           # [S]
    log_norm_full: torch.Tensor,   # [S] logsumexp over the whole vocabulary
) -> torch.Tensor:                 # [S, N] kept probabilities, renormalized; 0 elsewhere
    """Top-k, top-p and min-p on rank-sorted logits, each row with its own values."""
    n = sorted_logits.shape[1]
    rank = torch.arange(n, device=sorted_logits.device).unsqueeze(0)       # [1, N]
    is_k_on = top_k > 0
    keep = rank < torch.where(is_k_on, top_k, torch.full_like(top_k, n)).unsqueeze(1)  # [S, N]
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    # Probabilities of the top-k distribution over the whole vocabulary: with
    # top-k off the normalizer is the full one (the head may be a prefix only).
    log_norm = torch.where(is_k_on, torch.logsumexp(masked, dim=1), log_norm_full)  # [S]
    probs = torch.exp(masked - log_norm.unsqueeze(1))                      # [S, N]
    # Top-p keeps the shortest head whose mass reaches top_p: a token stays while
    # the mass *before* it is still short of top_p, so the best token always stays.
    mass_before = torch.cumsum(probs, dim=1) - probs
    keep &= mass_before < top_p.unsqueeze(1)
    # Min-p is relative to the best token, so renormalizing after top-k/top-p
    # would not move it; compare against the current probabilities directly.
    keep &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    keep[:, 0] = True  # never an empty set, even with min_p == 1 and float round-off
    return torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=1)


def _head_holds_kept_set(head_logits, top_k, top_p, min_p, log_norm_full, head_size) -> torch.Tensor:
    """[S] bool: every token the filters keep lies in the first ``head_size`` ranks.

    ``head_logits`` [S, head_size + 1] are the top ranks; the extra one tells
    whether min-p already drops everything past the head.
    """
    probs = torch.exp(head_logits - log_norm_full.unsqueeze(1))            # [S, head + 1]
    by_k = (top_k > 0) & (top_k <= head_size)
    by_p = (top_p < 1.0) & (probs[:, :head_size].sum(dim=1) >= top_p)
    by_min_p = probs[:, head_size] < min_p * probs[:, 0]
    return by_k | by_p | by_min_p


def kept_candidates(
    logits: torch.Tensor,          # [S, V], already suppressed
    temperature: torch.Tensor,     # [S] > 0
    top_k: torch.Tensor,           # [S] long, 0 = off
    top_p: torch.Tensor,           # [S]
    min_p: torch.Tensor,           # [S]
    head_size: int = HEAD_SIZE,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row: (probabilities [N], token ids [N]) in rank order, after temperature and the filters.

    Whether a row uses the sorted head or a full sort depends on that row
    alone, so its result never depends on which rows share the batch.
    """
    num_rows, vocab = logits.shape
    scaled = logits.float() / temperature.float().unsqueeze(1)              # [S, V]
    top_p, min_p = top_p.float(), min_p.float()
    log_norm_full = torch.logsumexp(scaled, dim=1)                          # [S]
    out: list = [None] * num_rows
    full_rows = torch.arange(num_rows, device=logits.device)
    if vocab > head_size + 1:
        head_logits, head_ids = torch.topk(scaled, head_size + 1, dim=1)    # [S, head + 1], sorted
        in_head = _head_holds_kept_set(head_logits, top_k, top_p, min_p, log_norm_full, head_size)
        head_rows = torch.nonzero(in_head).flatten()
        if len(head_rows):
            probs = _filter_sorted(head_logits[head_rows, :head_size], top_k[head_rows],
                                   top_p[head_rows], min_p[head_rows], log_norm_full[head_rows])
            for j, row in enumerate(head_rows.tolist()):
                out[row] = (probs[j], head_ids[row, :head_size])
        full_rows = torch.nonzero(~in_head).flatten()
    if len(full_rows):
        # A stable sort gives every row the same ranks however the batch is built.
        sorted_logits, order = torch.sort(scaled[full_rows], dim=1, descending=True, stable=True)
        probs = _filter_sorted(sorted_logits, top_k[full_rows], top_p[full_rows],
                               min_p[full_rows], log_norm_full[full_rows])   # [F, V]
        for j, row in enumerate(full_rows.tolist()):
            out[row] = (probs[j], order[j])
    return out


def filtered_probs(logits, temperature, top_k, top_p, min_p, head_size: int = HEAD_SIZE) -> torch.Tensor:
    """The filtered distribution of every row in vocabulary order, [B, V] (zero outside the kept set)."""
    dense = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    for row, (probs, ids) in enumerate(kept_candidates(logits, temperature, top_k, top_p, min_p, head_size)):
        dense[row, ids] = probs
    return dense


def _draw(probs: torch.Tensor, ids: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [N] over ids [N], on the generator's device so its stream is the only input."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    pick = int(torch.multinomial(probs, 1, generator=generator).item())
    return int(ids[pick].item())


def sample_next(
    logits: torch.Tensor,                      # [B, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    num_generated: Sequence[int],
    eos_token_ids: set[int],
    min_p_override: Sequence[float | None] | None = None,
    output_tokens: Sequence[Sequence[int]] | None = None,
    prompt_tokens: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:                             # [B] long
    """Pick each row's next token. ``min_p_override[i]`` (when not None) replaces row i's min-p;
    ``output_tokens`` / ``prompt_tokens`` (per row) are what the penalties count."""
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
    logits = suppress_tokens(logits, banned)                                # [B, V], a copy
    logit_adjust.adjust(logits, params, output_tokens, prompt_tokens)
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
    candidates = kept_candidates(
        logits[rows],
        torch.tensor([params[i].temperature for i in sampled_rows], device=dev),
        torch.tensor([params[i].top_k for i in sampled_rows], device=dev, dtype=torch.long),
        torch.tensor([params[i].top_p for i in sampled_rows], device=dev),
        torch.tensor(min_ps, device=dev),
    )
    for (probs, ids), i in zip(candidates, sampled_rows):
        next_tokens[i] = _draw(probs, ids, generators[i])
    return next_tokens
