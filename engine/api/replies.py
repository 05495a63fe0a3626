"""One request's progress (token batches, then its end) -> OpenAI response objects and stream chunks.

``CompletionReply`` and ``ChatReply`` turn the engine's tokens into text (``TextStream``),
logprobs and, for chat, reasoning / answer / tool calls (``output_parse``). They know nothing
of HTTP: the server feeds them what the outbox delivers and sends what they return.
"""
from __future__ import annotations

import time
import uuid

from engine.api.wire import Ended, Tokens
from engine.api.output_parse import TOOL_START, parse_reply, split_reasoning
from engine.api.parse import EngineInfo, EngineRequest
from engine.api.text_stream import TextStream

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(prompt_len: int, output_len: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": output_len, "total_tokens": prompt_len + output_len}


class _Reply:
    OBJECT = ""

    def __init__(self, info: EngineInfo, request: EngineRequest) -> None:
        self.info, self.request = info, request
        self.id = f"{self.PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        hidden = frozenset(request.sampling["stop_token_ids"]) | info.eos_ids
        self.text = TextStream(info.tokenizer.decode, request.features.stop_strings, hidden)
        self.logprobs: list = []
        self.token_ids: list[int] = []
        self.ended: Ended | None = None

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.info.model_name}

    def _token_text(self, token: int) -> str:
        return self.info.token_text(token)

    def usage(self) -> dict:
        assert self.ended is not None
        return usage(self.ended.prompt_len, self.ended.output_len)

    def finish_reason(self) -> str:
        assert self.ended is not None
        return FINISH_REASONS.get(self.ended.finish_reason or "", self.ended.finish_reason or "stop")

    def usage_chunk(self) -> dict:
        return {**self._base(self.CHUNK_OBJECT), "choices": [], "usage": self.usage()}


class CompletionReply(_Reply):
    PREFIX, CHUNK_OBJECT = "cmpl", "text_completion"

    def _logprobs(self, tokens: list[int], logprobs: list) -> dict | None:
        if self.request.features.logprobs is None:
            return None
        texts = [self._token_text(t) for t in tokens]
        return {"tokens": texts, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [self._top_dict(top) for _, top in logprobs],
                "text_offset": [0] * len(tokens)}

    def _top_dict(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """The legacy text -> logprob map; when two ids decode to the same text the likelier one stays."""
        out: dict[str, float] = {}
        for token, logprob in top:
            out.setdefault(self._token_text(token), logprob)
        return out

    def on_tokens(self, item: Tokens) -> list[dict]:
        self.token_ids += item.token_ids
        self.logprobs += item.logprobs
        delta = self.text.push(item.token_ids)
        logprobs = self._logprobs(item.token_ids, item.logprobs)
        if not delta and logprobs is None:
            return []
        return [{**self._base("text_completion"),
                 "choices": [{"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": None}]}]

    def on_end(self, item: Ended) -> list[dict]:
        self.ended = item
        return [{**self._base("text_completion"), "choices": [
            {"index": 0, "text": self.text.finish(), "logprobs": None, "finish_reason": self.finish_reason()}]}]

    def response(self) -> dict:
        return {**self._base("text_completion"), "usage": self.usage(), "choices": [
            {"index": 0, "text": self.text.full_text(), "finish_reason": self.finish_reason(),
             "logprobs": self._logprobs(self.token_ids, self.logprobs)}]}


class ChatReply(_Reply):
    PREFIX, CHUNK_OBJECT = "chatcmpl", "chat.completion.chunk"

    def __init__(self, info: EngineInfo, request: EngineRequest) -> None:
        super().__init__(info, request)
        self.thinking = request.features.enable_thinking
        self.sent_reasoning = ""
        self.sent_content = ""
        self.started = False

    def _logprobs(self, tokens: list[int], logprobs: list) -> dict | None:
        if self.request.features.logprobs is None:
            return None
        content = []
        for token, (lp, top) in zip(tokens, logprobs):
            text = self._token_text(token)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self._token_text(i), "logprob": v,
                                              "bytes": list(self._token_text(i).encode())} for i, v in top]})
        return {"content": content}

    def _chunk(self, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        return {**self._base("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def _streamable(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the text so far that may be sent: content stops at a tool call."""
        reasoning, content = split_reasoning(text, self.thinking)
        if self.request.tools_allowed:
            cut = content.find(TOOL_START)
            if cut < 0:  # hold back a tail that may still become "<tool_call>"
                cut = next((i for i in range(max(0, len(content) - len(TOOL_START)), len(content))
                            if TOOL_START.startswith(content[i:])), len(content))
            content = content[:cut]
        return reasoning or "", content

    def _deltas(self, reasoning: str, content: str) -> dict:
        delta = {}
        if not self.started:
            delta["role"], self.started = "assistant", True
        if len(reasoning) > len(self.sent_reasoning) and reasoning.startswith(self.sent_reasoning):
            delta["reasoning_content"] = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if len(content) > len(self.sent_content) and content.startswith(self.sent_content):
            delta["content"] = content[len(self.sent_content):]
            self.sent_content = content
        return delta

    def on_tokens(self, item: Tokens) -> list[dict]:
        self.token_ids += item.token_ids
        self.logprobs += item.logprobs
        self.text.push(item.token_ids)
        delta = self._deltas(*self._streamable(self.text.full_text()[:self.text.sent]))
        logprobs = self._logprobs(item.token_ids, item.logprobs)
        return [self._chunk(delta, logprobs)] if delta or logprobs else []

    def on_end(self, item: Ended) -> list[dict]:
        self.ended = item
        self.text.finish()
        parsed = self._parsed()
        delta = self._deltas(parsed.reasoning or "", parsed.content or "")
        chunks = [self._chunk(delta)] if delta else []
        if parsed.tool_calls:
            calls = [{"index": i, **call} for i, call in enumerate(parsed.tool_calls)]
            chunks.append(self._chunk({"tool_calls": calls}))
        last = self._chunk({}, finish_reason=self._finish_reason(parsed))
        if parsed.tool_call_errors:
            last["choices"][0]["tool_call_parse_errors"] = parsed.tool_call_errors
        return chunks + [last]

    def _parsed(self):
        return parse_reply(self.text.full_text(), thinking=self.thinking, tools_allowed=self.request.tools_allowed)

    def _finish_reason(self, parsed) -> str:
        return "tool_calls" if parsed.tool_calls and self.ended.finish_reason in ("eos", "stop") else \
            self.finish_reason()

    def response(self) -> dict:
        parsed = self._parsed()
        message = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning,
                   "tool_calls": parsed.tool_calls}
        choice = {"index": 0, "message": message, "finish_reason": self._finish_reason(parsed),
                  "logprobs": self._logprobs(self.token_ids, self.logprobs)}
        if parsed.tool_call_errors:
            # Not OpenAI's: says why the text of a (forced) tool call did not become a tool call.
            choice["tool_call_parse_errors"] = parsed.tool_call_errors
        return {**self._base("chat.completion"), "usage": self.usage(), "choices": [choice]}
