"""Multi-turn conversations: every turn resends the whole conversation so far.

Turn k's prompt = turn k-1's prompt + a stand-in for turn k-1's answer +
new user tokens, so each turn's prompt starts with the previous one and a
prefix cache can skip it. All conversations also open with one shared system
prompt. The stand-in answer is fixed seeded tokens (the model's real answer
is not known when the workload is built), with the same length as the
previous turn's ``max_tokens``.

Conversations start as a Poisson process at ``rate``; each next turn arrives
one think time (exponential, mean ``think_time_s``) after the previous turn's
arrival, plus ``answer_time_s`` per answer token as a stand-in for the time
the previous answer took.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

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
    sort_and_number,
)


@dataclass(frozen=True)
class MultiTurnConfig:
    num_conversations: int = 8
    num_turns: int = 4
    rate: float = 1.0  # conversation starts per second
    think_time_s: float = 2.0
    answer_time_s: float = 0.0  # per answer token, added to the think time
    system_prompt_len: int = 32  # shared by every conversation; 0 for none
    user_len_median: float = 48
    user_len_sigma: float = 0.5
    user_len_min: int = 4
    user_len_max: int = 256
    output_len: int = 24
    greedy_fraction: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("num_conversations", self.num_conversations, integer=True)
        check_positive("num_turns", self.num_turns, integer=True)
        check_positive("rate", self.rate)
        check_positive("think_time_s", self.think_time_s, allow_zero=True)
        check_positive("answer_time_s", self.answer_time_s, allow_zero=True)
        check_positive("system_prompt_len", self.system_prompt_len, allow_zero=True, integer=True)
        check_positive("user_len_median", self.user_len_median)
        check_positive("user_len_sigma", self.user_len_sigma, allow_zero=True)
        check_positive("user_len_min", self.user_len_min, integer=True)
        check_positive("user_len_max", self.user_len_max, integer=True)
        if self.user_len_min > self.user_len_max:
            raise WorkloadError(f"user_len_min {self.user_len_min} is above user_len_max {self.user_len_max}")
        check_positive("output_len", self.output_len, integer=True)
        check_sampling_mix(self.greedy_fraction, self.seed)


class MultiTurnWorkload:
    def __init__(self, *, vocab_size: int, excluded_ids: Iterable[int] = (), **config: Any):
        self.config = build_config(MultiTurnConfig, "multiturn", config)
        self.tokens = TokenDrawer(vocab_size, excluded_ids)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests())

    def requests(self) -> list[RequestSpec]:
        cfg = self.config
        rng = random.Random(f"{cfg.seed}:multiturn")
        system_prompt = self.tokens.draw(rng, cfg.system_prompt_len)
        specs, start = [], 0.0
        for conversation in range(cfg.num_conversations):
            if conversation:
                start += rng.expovariate(cfg.rate)
            history, arrival = list(system_prompt), start
            for turn in range(cfg.num_turns):
                user_len = clipped_lognormal(rng, cfg.user_len_median, cfg.user_len_sigma,
                                             cfg.user_len_min, cfg.user_len_max)
                prompt = history + self.tokens.draw(rng, user_len)
                sampling = mixed_sampling(rng, cfg.output_len, cfg.greedy_fraction)
                specs.append(RequestSpec(request_id=-1, arrival_s=arrival, prompt_tokens=prompt,
                                         sampling=sampling, conversation_id=conversation, turn=turn))
                history = prompt + self.tokens.draw(rng, cfg.output_len)
                arrival += rng.expovariate(1.0 / cfg.think_time_s) if cfg.think_time_s > 0 else 0.0
                arrival += cfg.answer_time_s * cfg.output_len
        return sort_and_number(specs)

    def describe(self) -> dict[str, Any]:
        specs = self.requests()
        num_shared = sum(len(prev.prompt_tokens) for prev, cur in _turn_pairs(specs))
        num_prompt = sum(s.prompt_len for s in specs)
        return {"kind": "multiturn", **asdict(self.config), "vocab_size": self.tokens.vocab_size,
                "num_excluded_ids": self.tokens.num_excluded,
                # Upper bound on what a prefix cache could reuse (previous turns only).
                "reusable_prompt_ratio": round(num_shared / num_prompt, 4) if num_prompt else 0.0,
                **length_summary(specs)}


def _turn_pairs(specs: list[RequestSpec]) -> list[tuple[RequestSpec, RequestSpec]]:
    by_turn = {(s.conversation_id, s.turn): s for s in specs}
    return [(by_turn[(s.conversation_id, s.turn - 1)], s) for s in specs if s.turn]
