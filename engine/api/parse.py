"""A validated request body -> what the engine runs: prompt tokens, sampling, features.

One place maps every OpenAI field to the engine's parameters and checks what only the
engine's size can decide (vocabulary, context, KV cache), so a bad request is answered
with a 400 naming the field before anything reaches the tick loop. A new field is a line
in ``protocol.py`` and a line here. One HTTP request becomes one engine request per choice:
a list of prompts times ``n`` (``fan_out``; ``choices.py`` joins their replies).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engine.api.chat_template import ChatTemplate, ChatTemplateError
from engine.api import structured, unsupported
from engine.api.errors import APIError, bad_request
from engine.api.images import image_reader
from engine.multimodal.limits import content_hash
from engine.api.protocol import (MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, SamplingFields,
                                 stop_list)
from engine.scheduler.request_features import SOURCE_API, RequestFeatures

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class EngineInfo:
    """What the API knows of the engine: fixed at start, read-only from the HTTP thread."""

    model_name: str
    vocab_size: int
    max_context: int
    num_kv_blocks: int
    block_size: int
    tokenizer: Any                 # engine.model.tokenizer.Tokenizer (encode / decode / token_id)
    chat_template: ChatTemplate
    has_tool_call_token: bool
    eos_ids: frozenset[int] = frozenset()
    grammars: Any = None           # engine.grammar.compiler.GrammarCompiler (None: no grammar support)
    tool_call_start_id: int | None = None
    tool_call_end_id: int | None = None
    images: Any = None             # engine.multimodal.limits.ImagePolicy (None: the model takes no images)
    # id -> (its name, its exact bytes) for logprobs: filled as ids come, HTTP thread only
    _token_names: dict[int, tuple[str, list[int]]] = field(default_factory=dict, compare=False, repr=False)

    def token_name(self, token: int) -> tuple[str, list[int]]:
        """(the token's text, its exact bytes): a token that is part of a UTF-8 character is named
        ``bytes:\\xe2\\x80`` (OpenAI's convention), so tokens with different bytes never share a name."""
        named = self._token_names.get(token)
        if named is None:
            raw = self.token_bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            named = self._token_names[token] = (text, list(raw))
        return named

    def token_bytes(self, token: int) -> bytes:
        """The token's exact bytes (llguidance's view of the vocabulary: the grammar compiler's tokenizer)."""
        if self.grammars is not None:
            return self.grammars.tokenizer.decode_bytes([token])
        return self.tokenizer.decode([token]).encode()


@dataclass(frozen=True)
class EngineRequest:
    """One choice of an HTTP request: what one engine request runs, and how its reply reads."""

    prompt_tokens: list[int]
    sampling: dict[str, Any]
    features: RequestFeatures
    stream: bool
    include_usage: bool
    tools_allowed: bool = False    # chat: parse tool calls out of the reply
    grammar: dict | None = None    # what the output obeys (engine/grammar/spec.py)
    index: int = 0                 # the choice's index in the response
    echo: str | None = None        # completions with echo: the prompt text the reply starts with
    hide_output: bool = False      # echo with max_tokens 0: the prompt alone (the engine's one token is dropped)
    approximations: tuple[str, ...] = ()   # schema keywords a lenient grammar ignored (structured.py)
    images: tuple[bytes, ...] = ()  # the images ``features.images`` names, in prompt order (engine/api/images.py)


def validate(model_cls: type, raw: bytes):
    """The body as ``model_cls``, or a 400 naming the first bad field."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw)} bytes, more than {MAX_BODY_BYTES}", code="body_too_large")
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if isinstance(p, int) or p in model_cls.model_fields or p in
               _nested_names]
        param = ".".join(loc) or None
        if first["type"] == "json_invalid":
            raise bad_request(f"malformed JSON body: {first['msg']}", None, "invalid_json") from None
        where = f"{param}: " if param else ""
        raise bad_request(f"{where}{first['msg']} (got {first.get('input')!r:.80})", param) from None


_nested_names = {"messages", "role", "content", "tools", "function", "name", "tool_choice", "include_usage",
                 "enable_thinking", "tool_calls", "arguments", "type", "parameters"}


def check_model(info: EngineInfo, model: str) -> None:
    if model != info.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {info.model_name!r}",
                       param="model", type="not_found_error", code="model_not_found")


def prompts_of(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts (a string or token ids each)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def completion_requests(info: EngineInfo, body: CompletionRequest) -> list[EngineRequest]:
    """One engine request per prompt and choice (prompt 0's n choices first, as OpenAI orders them)."""
    check_model(info, body.model)
    _check_common(body, chat=False)
    prompts = prompts_of(body.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens: 0 is only meaningful with echo (the prompt alone)", "max_tokens")
    grammar, approximations = structured.grammar_for(info, response_format=body.response_format,
                                                     structured_outputs=body.structured_outputs)
    out: list[EngineRequest] = []
    for prompt in prompts:
        tokens = info.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((t for t in tokens if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {info.vocab_size})", "prompt")
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else info.tokenizer.decode(tokens)
        features = RequestFeatures(source=SOURCE_API, stop_strings=tuple(stop_list(body.stop)),
                                   logprobs=body.logprobs,
                                   prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
        max_tokens = 16 if body.max_tokens is None else max(body.max_tokens, 1)
        one = _engine_request(info, body, tokens, max_tokens, features, (), tools_allowed=False, grammar=grammar)
        out += fan_out(one, body.n, first_index=len(out), echo=echo, hide_output=body.max_tokens == 0,
                       approximations=approximations)
    return out


def chat_requests(info: EngineInfo, body: ChatCompletionRequest) -> list[EngineRequest]:
    """The chat's n choices, one engine request each."""
    check_model(info, body.model)
    _check_common(body, chat=True)
    kwargs = body.chat_template_kwargs.model_dump() if body.chat_template_kwargs else {}
    thinking = bool(kwargs.pop("enable_thinking", False))
    choice = body.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if choice is not None and not isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice: function {choice.function.name!r} is not among tools {names}",
                              "tool_choice")
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    if choice in ("required",) and not tools:
        raise bad_request("tool_choice: 'required' needs at least one tool in tools", "tool_choice")
    require_tool = choice == "required" or (choice is not None and not isinstance(choice, str))
    if require_tool and not info.has_tool_call_token:
        raise bad_request("tool_choice: the model has no tool-call start token to force", "tool_choice")
    if choice == "none":
        tools = []
    images: list[tuple[bytes, int]] = []
    image_text = image_reader(info.images, images)
    messages = [m.model_dump(exclude_none=True) | {"content": m.text(image_text)} for m in body.messages]
    try:
        text = info.chat_template.render(messages, tools, enable_thinking=thinking, extra=kwargs)
    except ChatTemplateError as exc:
        raise bad_request(f"messages: {exc}", "messages") from None
    tokens = info.tokenizer.encode(text)
    if info.images is not None and tokens.count(info.images.pad_id) != sum(n for _, n in images):
        raise bad_request("messages: the text holds image placeholder tokens of its own", "messages")
    features = RequestFeatures(source=SOURCE_API, enable_thinking=thinking, require_tool_call=require_tool,
                               images=tuple(content_hash(data) for data, _ in images),
                               stop_strings=tuple(stop_list(body.stop)),
                               logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    im_end = info.tokenizer.token_id("<|im_end|>")
    max_tokens = body.max_completion_tokens or body.max_tokens
    grammar, approximations = structured.grammar_for(info, response_format=body.response_format,
                                                     structured_outputs=body.structured_outputs,
                                                     tools=tools if require_tool else None, tool_choice=choice,
                                                     enable_thinking=thinking)
    one = _engine_request(info, body, tokens, max_tokens, features, (im_end,) if im_end is not None else (),
                          tools_allowed=bool(tools), grammar=grammar)
    one = dataclasses.replace(one, images=tuple(data for data, _ in images))
    return fan_out(one, body.n, first_index=0, approximations=approximations)


def fan_out(request: EngineRequest, n: int, *, first_index: int, echo: str | None = None,
            hide_output: bool = False, approximations: tuple[str, ...] = ()) -> list[EngineRequest]:
    """``n`` sibling engine requests of one prompt, indexed from ``first_index`` (``choices.py``
    says why siblings: the prefix cache shares their prompt). With a seed, choice i gets seed + i."""
    out = []
    seed = request.sampling["seed"]
    for choice in range(n):
        sampling = {**request.sampling, "seed": None if seed is None else seed + choice}
        features = dataclasses.replace(request.features, n=n, choice=choice)
        out.append(dataclasses.replace(request, sampling=sampling, features=features, index=first_index + choice,
                                       echo=echo, hide_output=hide_output, approximations=approximations))
    return out


def _check_common(body: SamplingFields, *, chat: bool) -> None:
    """What both endpoints refuse before any tokenizing: unsupported fields, stream_options without stream."""
    unsupported.refuse(body.model_extra, chat=chat)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed with stream: true", "stream_options")


def logit_bias_pairs(info: EngineInfo, bias: dict[str, float] | None) -> list[list]:
    """OpenAI's {"token id": bias} as sorted [id, bias] pairs; a key that is not a token id is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or not 0 <= int(key) < info.vocab_size:
            raise bad_request(f"logit_bias: {key!r:.40} is not a token id in [0, {info.vocab_size})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias: the bias of {key} is {value}, outside [-100, 100]", "logit_bias")
        pairs.append([int(key), float(value)])
    return sorted(pairs)


def _engine_request(info: EngineInfo, body: SamplingFields, tokens: list[int], max_tokens: int | None,
                    features: RequestFeatures, end_of_turn: tuple[int, ...], *, tools_allowed: bool,
                    grammar: dict | None = None) -> EngineRequest:
    if not tokens:
        raise bad_request("prompt: empty prompt (at least one token is needed)", "prompt")
    room = info.max_context - len(tokens)
    if room < 1:
        raise bad_request(f"prompt: {len(tokens)} tokens do not fit the model's context of {info.max_context}",
                          "prompt", "context_length_exceeded")
    if max_tokens is None:   # as much as the context and the whole KV cache leave (vLLM's default)
        max_tokens = min(room, info.num_kv_blocks * info.block_size - len(tokens))
        if max_tokens < 1:
            raise bad_request(f"prompt: {len(tokens)} tokens fill the whole KV cache", "prompt", "kv_cache_exceeded")
    if len(tokens) + max_tokens > info.max_context:
        raise bad_request(f"max_tokens: {len(tokens)} prompt + {max_tokens} max_tokens exceed the model's "
                          f"context of {info.max_context}", "max_tokens", "context_length_exceeded")
    needed = -(-(len(tokens) + max_tokens) // info.block_size)
    if needed > info.num_kv_blocks:
        raise bad_request(f"max_tokens: {len(tokens)} prompt + {max_tokens} max_tokens need {needed} KV blocks, "
                          f"more than the whole cache ({info.num_kv_blocks} blocks of {info.block_size} tokens)",
                          "max_tokens", "kv_cache_exceeded")
    if len(features.stop_strings) > 16 or any(not s for s in features.stop_strings):
        raise bad_request("stop: at most 16 non-empty strings", "stop")
    stop_ids = list(body.stop_token_ids or []) + list(end_of_turn)
    bad = next((t for t in stop_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"stop_token_ids: {bad} is outside the vocabulary [0, {info.vocab_size})", "stop_token_ids")
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens: {body.min_tokens} is more than max_tokens {max_tokens}", "min_tokens")
    sampling = {"temperature": body.temperature, "top_k": max(body.top_k, 0), "top_p": body.top_p,
                "min_p": body.min_p, "min_tokens": body.min_tokens, "max_tokens": max_tokens, "seed": body.seed,
                "stop_token_ids": sorted(set(stop_ids)), "logit_bias": logit_bias_pairs(info, body.logit_bias),
                "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                "repetition_penalty": body.repetition_penalty}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EngineRequest(tokens, sampling, features, body.stream, include_usage, tools_allowed, grammar)
