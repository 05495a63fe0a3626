"""Synthetic workload: seeded arrivals, lengths and sampling parameters.

Arrivals are Poisson (exponential gaps at ``rate`` per second) or bursty:
gamma gaps with the same mean and a coefficient of variation ``cv`` (cv = 1
is Poisson again, cv > 1 clusters requests into bursts with quiet spells).
Prompt and output lengths are lognormal around a median, clipped. The same
seed gives the same workload, token for token.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

from engine.workload.grammars import GRAMMAR_MAX_TOKENS, draw_grammar
from engine.workload.request import (
    build_config,
    check_sampling_mix,
    RequestSpec,
    TokenDrawer,
    WorkloadError,
    check_positive,
    clipped_lognormal,
    length_summary,
    mixed_sampling,
)

ARRIVAL_KINDS = ("poisson", "gamma")


@dataclass(frozen=True)
class SyntheticConfig:
    num_requests: int = 64
    rate: float = 4.0  # requests per second
    arrival: str = "poisson"  # poisson | gamma
    cv: float = 1.0  # gamma gaps: std / mean
    prompt_len_median: float = 64
    prompt_len_sigma: float = 0.6
    prompt_len_min: int = 4
    prompt_len_max: int = 512
    output_len_median: float = 24
    output_len_sigma: float = 0.6
    output_len_min: int = 1
    output_len_max: int = 128
    greedy_fraction: float = 0.5
    force_output_len: bool = True  # min_tokens = max_tokens
    seed: int = 0
    grammar_share: float = 0.0  # share of requests with a built-in grammar (workload/grammars.py)

    def __post_init__(self) -> None:
        check_positive("num_requests", self.num_requests, allow_zero=True, integer=True)
        check_positive("rate", self.rate)
        if self.arrival not in ARRIVAL_KINDS:
            raise WorkloadError(f"arrival must be one of {ARRIVAL_KINDS}, got {self.arrival!r}")
        check_positive("cv", self.cv)
        for which in ("prompt", "output"):
            check_positive(f"{which}_len_median", getattr(self, f"{which}_len_median"))
            check_positive(f"{which}_len_sigma", getattr(self, f"{which}_len_sigma"), allow_zero=True)
            low, high = getattr(self, f"{which}_len_min"), getattr(self, f"{which}_len_max")
            check_positive(f"{which}_len_min", low, integer=True)
            check_positive(f"{which}_len_max", high, integer=True)
            if low > high:
                raise WorkloadError(f"{which}_len_min {low} is above {which}_len_max {high}")
        check_sampling_mix(self.greedy_fraction, self.seed)
        share = self.grammar_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise WorkloadError(f"grammar_share must be in [0, 1], got {share!r}")


def arrival_gaps(rng: random.Random, num: int, rate: float, arrival: str, cv: float) -> list[float]:
    """Inter-arrival gaps (seconds) with mean 1/rate."""
    if arrival == "poisson":
        return [rng.expovariate(rate) for _ in range(num)]
    shape = 1.0 / (cv * cv)  # gamma: mean = shape*scale, cv = 1/sqrt(shape)
    scale = 1.0 / (rate * shape)
    return [rng.gammavariate(shape, scale) for _ in range(num)]


class SyntheticWorkload:
    def __init__(self, *, vocab_size: int, excluded_ids: Iterable[int] = (), **config: Any):
        self.config = build_config(SyntheticConfig, "synthetic", config)
        self.tokens = TokenDrawer(vocab_size, excluded_ids)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests())

    def requests(self) -> list[RequestSpec]:
        cfg = self.config
        # Separate streams: changing a length knob leaves the arrival times alone.
        arrival_rng = random.Random(f"{cfg.seed}:arrivals")
        rng = random.Random(f"{cfg.seed}:requests")
        # Its own stream too: a grammar share of 0 leaves every other draw as it was.
        grammar_rng = random.Random(f"{cfg.seed}:grammars")
        gaps = arrival_gaps(arrival_rng, cfg.num_requests, cfg.rate, cfg.arrival, cfg.cv)
        specs, now = [], 0.0
        for i, gap in enumerate(gaps):
            # The first request arrives at 0: a run starts with work to do.
            now = now + gap if i else 0.0
            prompt_len = clipped_lognormal(rng, cfg.prompt_len_median, cfg.prompt_len_sigma,
                                           cfg.prompt_len_min, cfg.prompt_len_max)
            output_len = clipped_lognormal(rng, cfg.output_len_median, cfg.output_len_sigma,
                                           cfg.output_len_min, cfg.output_len_max)
            spec = RequestSpec(
                request_id=i,
                arrival_s=now,
                prompt_tokens=self.tokens.draw(rng, prompt_len),
                sampling=mixed_sampling(rng, output_len, cfg.greedy_fraction, force_length=cfg.force_output_len),
            )
            if cfg.grammar_share and grammar_rng.random() < cfg.grammar_share:
                # The grammar decides the length: room for a complete answer, EOS never banned.
                spec.grammar = draw_grammar(grammar_rng)
                spec.sampling.update(max_tokens=GRAMMAR_MAX_TOKENS, min_tokens=0)
            specs.append(spec)
        return specs

    def describe(self) -> dict[str, Any]:
        return {"kind": "synthetic", **asdict(self.config), "vocab_size": self.tokens.vocab_size,
                "num_excluded_ids": self.tokens.num_excluded, **length_summary(self.requests())}
