"""n > 1 and lists of prompts: one HTTP request, several engine requests, one response.

Each choice is its own engine request (``parse.fan_out``): the n choices of a prompt are siblings
with the same prompt tokens, so every sibling after the first finds the prompt's blocks and
SSM snapshot in the prefix cache (``engine/scheduler/siblings.py`` makes the first keep the
snapshot the others need) and prefills only the prompt's last partial block. With a seed,
choice i samples with seed + i (vLLM's rule), so each choice replays on its own; without
one the engine gives each its own.

The response id is ``chatcmpl-<hex>-<request id>`` (``cmpl-`` for completions): its suffix is the
engine's request id of the first choice, and the ``x-chunkscope-request-ids`` header lists every
choice's, so the Chunks and Requests pages find the request by either.

``Choices`` joins the replies: stream chunks carry their choice's index, the whole response
lists the choices in index order, and the usage counts each prompt once and every choice's
output. The first choice that ends without finishing ends the whole request (the rest are
cancelled by the server).
"""
from __future__ import annotations

import time
import uuid

from engine.api.parse import EngineInfo, EngineRequest
from engine.api.replies import ChatReply, CompletionReply, usage
from engine.api.wire import Ended, Tokens
from telemetry import events as ev


class Choices:
    """The replies of one HTTP request's choices, fed by index."""

    def __init__(self, info: EngineInfo, requests: list[EngineRequest], *, chat: bool) -> None:
        prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        self._id = f"{prefix}-{uuid.uuid4().hex}"
        self.base = {"id": self._id, "created": int(time.time()), "model": info.model_name}
        self.object = obj
        reply = ChatReply if chat else CompletionReply
        self.replies = [reply(info, r, self.base) for r in requests]
        self.num_open = len(requests)
        self.failed: Ended | None = None         # the first choice that ended without finishing

    def name_request(self, first_request_id: int | None) -> None:
        """The response id ends in the engine's request id of the first choice (the others follow
        it: siblings get consecutive ids), so the id a client logs finds the request on the dashboard."""
        if first_request_id is not None:
            self.base["id"] = f"{self._id}-{first_request_id}"

    @property
    def approximations(self) -> tuple[str, ...]:
        return self.replies[0].request.approximations

    @property
    def is_over(self) -> bool:
        return self.num_open == 0 or self.failed is not None

    def keep(self, index: int, item: Tokens | Ended) -> None:
        """A whole (non-streamed) response: take the item, build nothing yet."""
        if isinstance(item, Tokens):
            self.replies[index].keep(item)
        else:
            self.replies[index].end(item)
            self._ended(item)

    def on_item(self, index: int, item: Tokens | Ended) -> list[dict]:
        """A streamed response: the chunks this item makes."""
        reply = self.replies[index]
        if isinstance(item, Tokens):
            return reply.on_tokens(item)
        self._ended(item)
        return reply.on_end(item) if item.status == ev.REQ_FINISHED else []

    def _ended(self, item: Ended) -> None:
        self.num_open -= 1
        if item.status != ev.REQ_FINISHED and self.failed is None:
            self.failed = item

    def usage(self) -> dict:
        """Each prompt once (its first choice's count), every choice's output."""
        prompt = sum(r.ended.prompt_len for r in self.replies if r.request.features.choice == 0 and r.ended)
        return usage(prompt, sum(r.output_len for r in self.replies if r.ended))

    def usage_chunk(self) -> dict:
        return {**self.base, "object": self.replies[0].CHUNK_OBJECT, "choices": [], "usage": self.usage()}

    def response(self) -> dict:
        out = {**self.base, "object": self.object, "usage": self.usage(),
               "choices": [reply.choice() for reply in self.replies]}
        if self.approximations:
            out["grammar_approximations"] = list(self.approximations)
        return out
