"""First-token policy: what the token sampled at the end of prefill (token 0) may be.

The rules, decided once at the sequence's birth (``FirstTokenPolicy.for_birth``):

- ``min_tokens > 0``: token 0 may not end the reply, so EOS and the
  request's stop ids are banned (the same rule ``sample_next`` applies later).
- thinking enabled: the reply opens inside a think block, so token 0 may not
  close it (the think-end token is banned: an empty thought), may not end the
  reply from inside it (EOS / stop banned) and may not start a tool call
  (tool calls come after the thought). A required tool call is therefore not
  forced at token 0 under thinking; it comes after the think block.
- ``require_tool_call`` without thinking: token 0 is forced to the tool-call
  start token; no sampling happens. A model without such a token cannot
  honour the request: ValueError.
- grammar: a grammar constrains the answer itself, so it acts on token 0 only
  when nothing comes before the answer (thinking off) and no token is forced.

``sample_first_token`` applies the policy and samples with the request's
parameters (min-p possibly overridden, e.g. to 0.0 under MTP with the
``no_mtp_minp`` lever, see ``sampling.effective_min_p``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from engine.scheduler.sampling import SamplingParams, sample_next, suppress_tokens

RULE_MIN_TOKENS = "min_tokens"
RULE_THINKING = "thinking"
RULE_FORCE_TOOL_CALL = "force_tool_call"


@dataclass(frozen=True)
class FirstTokenPolicy:
    banned_ids: frozenset[int]          # model-specific ids banned at token 0 (think end, tool start)
    ban_eos: bool                       # EOS and the request's stop ids banned at token 0
    forced_token: int | None            # token 0 is this id, no sampling
    grammar_applies: bool               # a grammar's allowed set constrains token 0
    rules: tuple[str, ...]              # which rules fired, for telemetry

    @classmethod
    def for_birth(
        cls,
        enable_thinking: bool,
        think_end_token: int | None,
        tool_call_start_token: int | None,
        min_tokens: int,
        require_tool_call: bool,
    ) -> "FirstTokenPolicy":
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        rules: list[str] = []
        banned: set[int] = set()
        ban_eos = False
        forced = None
        if min_tokens > 0:
            rules.append(RULE_MIN_TOKENS)
            ban_eos = True
        if enable_thinking:
            rules.append(RULE_THINKING)
            ban_eos = True
            banned |= {t for t in (think_end_token, tool_call_start_token) if t is not None}
        elif require_tool_call:
            if tool_call_start_token is None:
                raise ValueError(
                    "require_tool_call is set but the model has no tool_call_start_token to force")
            rules.append(RULE_FORCE_TOOL_CALL)
            forced = tool_call_start_token
        return cls(frozenset(banned), ban_eos, forced, not enable_thinking and forced is None, tuple(rules))

    def banned_for(self, eos_ids: Collection[int], stop_ids: Collection[int]) -> frozenset[int]:
        """Every id token 0 may not be, given the request's EOS and stop ids."""
        ends = set(eos_ids) | set(stop_ids) if self.ban_eos else set()
        return frozenset(self.banned_ids | ends)


def sample_first_token(
    logits: torch.Tensor,                         # [V]
    params: SamplingParams,
    generator: torch.Generator | None,
    policy: FirstTokenPolicy,
    eos_ids: Collection[int],
    min_p_override: float | None = None,
    grammar_allowed_ids: Collection[int] | None = None,
    prompt_tokens: Sequence[int] = (),
) -> int:
    """Token 0 of a sequence: forced, or sampled with the policy's bans (and the grammar when it applies)."""
    if logits.dim() != 1:
        raise ValueError(f"first-token logits must be [V], got shape {tuple(logits.shape)}")
    vocab = logits.shape[0]
    if policy.forced_token is not None:
        if not 0 <= policy.forced_token < vocab:
            raise ValueError(f"forced first token {policy.forced_token} is outside the vocabulary [0, {vocab})")
        return policy.forced_token

    row = logits.unsqueeze(0)                                               # [1, V]
    banned = policy.banned_for(eos_ids, params.stop_token_ids)
    row = suppress_tokens(row, [[t for t in banned if 0 <= t < vocab]])
    if policy.grammar_applies and grammar_allowed_ids is not None:
        allowed = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        allowed[[t for t in grammar_allowed_ids if 0 <= t < vocab]] = True
        row = row.masked_fill(~allowed, float("-inf"))
    if not torch.isfinite(row).any():
        raise ValueError(
            f"first token: every token is banned (policy rules {policy.rules}, "
            f"{len(banned)} banned ids, grammar {'on' if grammar_allowed_ids is not None else 'off'})")
    token = sample_next(row, [params], [generator], [0], set(eos_ids), min_p_override=[min_p_override],
                        output_tokens=[()], prompt_tokens=[prompt_tokens])
    return int(token[0].item())
