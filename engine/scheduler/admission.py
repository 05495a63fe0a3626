"""Admission checks: a bad request is rejected with a message naming the field, before any forward."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.grammar.spec import GrammarSpec
from engine.multimodal.limits import ImageError
from engine.scheduler.context import ModelTraits
from engine.scheduler.request_features import RequestFeatures
from engine.scheduler.request import Request
from engine.scheduler.sampling import SamplingParams
from telemetry import events as ev


class RequestRejected(ValueError):
    """A request that can never run; the message names the offending field."""


def check_features(features: RequestFeatures | dict | None, traits: ModelTraits) -> RequestFeatures:
    """The request's features, validated against what this model can do."""
    try:
        feats = features if isinstance(features, RequestFeatures) else RequestFeatures.from_dict(features)
        feats.validate()
    except (TypeError, ValueError) as exc:
        raise RequestRejected(str(exc)) from None
    if feats.stop_strings and traits.detokenize is None:
        raise RequestRejected("features.stop_strings: the checkpoint has no tokenizer to read text with")
    if feats.require_tool_call and traits.tool_call_start_id is None:
        raise RequestRejected("features.require_tool_call: the model has no tool-call start token")
    return feats


def parse_sampling(raw: dict[str, Any] | SamplingParams, vocab_size: int) -> SamplingParams:
    """Build and validate sampling parameters; any problem becomes RequestRejected."""
    try:
        params = raw if isinstance(raw, SamplingParams) else SamplingParams.from_dict(dict(raw))
        return params.validate(vocab_size)
    except (TypeError, ValueError) as exc:
        raise RequestRejected(str(exc)) from None


def check_prompt(prompt_tokens: Sequence[Any], *, vocab_size: int, max_context: int,
                 num_usable_blocks: int, block_size: int, max_tokens: int) -> list[int]:
    """The prompt as a list of ints, or RequestRejected naming ``prompt_tokens``."""
    if len(prompt_tokens) == 0:
        raise RequestRejected("prompt_tokens: empty prompt (at least one token is needed)")
    tokens: list[int] = []
    for index, token in enumerate(prompt_tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            if isinstance(token, float) and math.isfinite(token) and token.is_integer():
                token = int(token)
            else:
                raise RequestRejected(f"prompt_tokens[{index}]: {token!r} is not an integer token id")
        if not 0 <= token < vocab_size:
            raise RequestRejected(
                f"prompt_tokens[{index}]: token id {token} is outside the vocabulary [0, {vocab_size})")
        tokens.append(token)
    if len(tokens) >= max_context:
        raise RequestRejected(
            f"prompt_tokens: {len(tokens)} tokens do not fit the model's context of {max_context}")
    # The whole sequence (prompt + every output token) must fit the KV cache on its own,
    # otherwise no amount of preemption can ever let it finish.
    needed_blocks = -(-(len(tokens) + max_tokens) // block_size)
    if needed_blocks > num_usable_blocks:
        raise RequestRejected(
            f"prompt_tokens: {len(tokens)} prompt + {max_tokens} max_tokens need {needed_blocks} KV blocks, "
            f"more than the whole cache ({num_usable_blocks} blocks of {block_size} tokens)")
    return tokens


def whole_prompt_refusal(prompt_len: int, max_tick_tokens: int) -> str | None:
    """Why a prompt can never start under the MLA whole-prompt rule (its one chunk over the tick's
    token budget), or None. Its blocks are checked with every prompt (``check_prompt``)."""
    if prompt_len <= max_tick_tokens:
        return None
    return (f"prompt_tokens: {prompt_len} tokens exceed the tick's token budget (max_tick_tokens = "
            f"{max_tick_tokens}); an MLA prompt runs as one whole chunk under the reference's rule "
            f"(mla_chunked_prefill off), so it can never start")


def rejected_request(request_id: int, prompt_tokens: Any, sampling: Any, features: Any, grammar: Any, *,
                     vocab_size: int, now_ns: int, tick: int, conversation_id: int | None) -> Request:
    """The ended request for one that failed its checks, kept as the client sent it, so its row
    shows what was asked and a replay rejects it for the same reason (the caller marks it rejected)."""
    request = Request(request_id, [], parse_sampling({}, vocab_size), now_ns, tick, conversation_id)
    request.sampling_record = dict(sampling) if isinstance(sampling, dict) else {}
    request.prompt_tokens = [t for t in prompt_tokens if isinstance(t, int)] if isinstance(
        prompt_tokens, (list, tuple)) else []
    if isinstance(grammar, dict):
        request.grammar_spec = recorded_spec(grammar)
    request.features_record = features.to_dict() if isinstance(features, RequestFeatures) else \
        dict(features) if isinstance(features, dict) else {}
    if isinstance(features, RequestFeatures):   # an API request stays one in its row
        request.features = features
    return request


def mark_rejected(request: Request, message: str) -> None:
    request.status, request.error, request.finish_reason = ev.REQ_REJECTED, message, "error"
    request.finished_ns = request.arrival_ns


def recorded_spec(raw: dict) -> GrammarSpec:
    """A rejected request's grammar as the client sent it, kept for its row (and a replay)."""
    return GrammarSpec(str(raw.get("kind")), raw.get("value"), bool(raw.get("after_think", False)))


def check_images(tokens: list[int], hashes: tuple[str, ...], images) -> Any:
    """The prompt's ``PromptImages`` (None without images), or RequestRejected naming the problem.

    ``images``: the engine's ``RequestImages`` (None: its checkpoint has no vision tower)."""
    if not hashes:
        return None
    if images is None:
        raise RequestRejected("features.images: this model takes no images (its checkpoint has no vision tower)")
    try:
        return images.prompt_images(tokens, hashes)
    except ImageError as exc:
        raise RequestRejected(f"features.images: {exc}") from None
