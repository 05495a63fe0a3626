"""Chat workload: seeded requests in the chat template, as a client of ``tiny-chat`` would send them.

Each request is one task of ``engine/train/tasks.py`` rendered by the model's chat template:
some with thinking on (the reply must close ``</think>``), some with tools and a required tool
call (held to the call's grammar after the thought), some answering in JSON under a schema (the
grammar starts after ``</think>``), the rest plain text (lists, code fences, repeated phrases).
Replies end at ``<|im_end|>`` (a stop token, as the API sets it). Arrivals are Poisson at
``rate``; sampling is greedy or one of the usual mixes, each with its own seed. On a checkpoint
with a vision tower a seeded ``image_share`` of the requests carries an image, placed as the API
places an ``image_url`` part in front of the user's text: its placeholder text opens the user's
turn, and ``features.images`` names it by content hash (the image pool: engine/workload/images.py).

Pure Python (the tokenizer and the template are passed in): no torch.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from collections.abc import Sequence
from typing import Any, Iterator

from engine.grammar.tools import tool_call_spec
from engine.scheduler.request_features import RequestFeatures
from engine.train.tasks import KIND_JSON, KIND_TEXT, KIND_TOOL, ChatTask, draw_json_task, draw_text_task, \
    draw_tool_task
from engine.workload.request import RequestSpec, WorkloadError, build_config, check_positive, check_sampling_mix, \
    length_summary, mixed_sampling
from engine.workload.synthetic import arrival_gaps


@dataclass(frozen=True)
class ChatConfig:
    num_requests: int = 64
    rate: float = 4.0               # requests per second (Poisson)
    seed: int = 0
    thinking_share: float = 0.5     # requests with thinking on
    tool_share: float = 0.25        # requests offering tools (most of them require a call)
    json_share: float = 0.25        # requests answering under a JSON schema
    max_tokens: int = 256
    greedy_fraction: float = 0.5
    image_share: float = 0.0        # requests with an image (needs ``images``: a checkpoint with a tower)

    def __post_init__(self) -> None:
        check_positive("num_requests", self.num_requests, allow_zero=True, integer=True)
        check_positive("rate", self.rate)
        check_positive("max_tokens", self.max_tokens, integer=True)
        check_sampling_mix(self.greedy_fraction, self.seed)
        for name in ("thinking_share", "tool_share", "json_share", "image_share"):
            share = getattr(self, name)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise WorkloadError(f"{name} must be in [0, 1], got {share!r}")
        if self.tool_share + self.json_share > 1:
            raise WorkloadError(f"tool_share + json_share must be <= 1, got {self.tool_share + self.json_share}")


@dataclass(frozen=True)
class ChatTokens:
    """The model's ids the workload needs: the turn's end (a stop id) and the tool-call bounds."""

    im_end: int
    tool_call_start: int
    tool_call_end: int

    @classmethod
    def of(cls, tokenizer: Any) -> "ChatTokens":
        ids = [tokenizer.token_id(t) for t in ("<|im_end|>", "<tool_call>", "</tool_call>")]
        if None in ids:
            raise WorkloadError("the chat workload needs a tokenizer with <|im_end|>, <tool_call> and </tool_call>")
        return cls(*ids)


class ChatWorkload:
    def __init__(self, *, tokenizer: Any, template: Any, images: Sequence[tuple[str, str]] = (), **config: Any):
        """``images``: the (placeholder text, content hash) pairs a request with an image draws from."""
        self.config = build_config(ChatConfig, "chat", config)
        self.tokenizer, self.template = tokenizer, template
        self.ids = ChatTokens.of(tokenizer)
        if self.config.image_share and not images:
            raise WorkloadError("image_share needs images (a checkpoint with a vision tower)")
        self.images = list(images)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests())

    def draw(self, rng: random.Random) -> ChatTask:
        """One task: tools, JSON or text by the shares; thinking by its share."""
        cfg = self.config
        thinking = rng.random() < cfg.thinking_share
        pick = rng.random()
        if pick < cfg.tool_share:
            return draw_tool_task(rng, thinking)
        if pick < cfg.tool_share + cfg.json_share:
            return draw_json_task(rng, thinking)
        return draw_text_task(rng, thinking)

    def request(self, rng: random.Random, request_id: int, arrival_s: float,
                image_rng: random.Random | None = None) -> RequestSpec:
        task = self.draw(rng)
        messages, image = task.messages, None
        # Images draw from their own stream, so the text requests are the same at any share.
        if image_rng is not None and image_rng.random() < self.config.image_share:
            placeholder, image = self.images[image_rng.randrange(len(self.images))]
            messages = with_image_first(messages, placeholder)
        prompt = self.template.render(messages + task.history, task.tools, enable_thinking=task.thinking)
        sampling = mixed_sampling(rng, self.config.max_tokens, self.config.greedy_fraction, force_length=False)
        sampling["stop_token_ids"] = [self.ids.im_end]
        required = task.kind == KIND_TOOL and task.tool_call is not None
        spec = RequestSpec(request_id, arrival_s, self.tokenizer.encode(prompt), sampling,
                           features=RequestFeatures(enable_thinking=task.thinking,
                                                    require_tool_call=required,
                                                    images=(image,) if image else ()).to_dict())
        if required:
            spec.grammar = tool_call_spec(task.tools, start_id=self.ids.tool_call_start,
                                          end_id=self.ids.tool_call_end, after_think=task.thinking).to_dict()
        elif task.kind == KIND_JSON:
            spec.grammar = {"kind": "json_schema", "value": task.schema, "after_think": task.thinking}
        return spec

    def requests(self) -> list[RequestSpec]:
        cfg = self.config
        gaps = arrival_gaps(random.Random(f"{cfg.seed}:arrivals"), cfg.num_requests, cfg.rate, "poisson", 1.0)
        rng = random.Random(f"{cfg.seed}:chat")
        image_rng = random.Random(f"{cfg.seed}:images") if cfg.image_share else None
        specs, now = [], 0.0
        for i, gap in enumerate(gaps):
            now = now + gap if i else 0.0
            specs.append(self.request(rng, i, now, image_rng))
        return specs

    def describe(self) -> dict[str, Any]:
        return {"kind": "chat", **asdict(self.config), **length_summary(self.requests())}


def with_image_first(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """``messages`` with ``placeholder`` opening the last user turn, as the API renders a user message whose
    content parts are an ``image_url`` then the text (parts joined with nothing between them)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = list(messages)
    out[last] = {**messages[last], "content": placeholder + messages[last]["content"]}
    return out


def task_kind(spec: RequestSpec) -> str:
    """text / tool / json of a chat workload request (what the bench and tests group by)."""
    if spec.features and spec.features.get("require_tool_call"):
        return KIND_TOOL
    return KIND_JSON if spec.grammar is not None else KIND_TEXT
