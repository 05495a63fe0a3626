"""One choice's progress (token batches, then its end) -> OpenAI choice objects and stream chunks.

``CompletionReply`` and ``ChatReply`` turn one engine request's tokens into text
(``TextStream``), logprobs and, for chat, reasoning / answer / tool calls (``output_parse``).
``choices.Choices`` joins the n (x prompts) of one HTTP request into one response. They know
nothing of HTTP: the server feeds them what the outbox delivers and sends what they return.

Logprobs are always JSON numbers: a token the grammar or a ban masked has logprob -inf, which
JSON cannot carry, so it is written as -9999.0 (vLLM's value). Each token is named by its
text, or ``bytes:\\xNN..`` when its bytes are part of a UTF-8 character, and ``bytes`` are
its exact bytes, so the bytes of consecutive tokens rebuild the text.
"""
from __future__ import annotations

import codecs
import math

from engine.api.wire import Ended, Tokens
from engine.api.output_parse import TOOL_START, parse_reply, split_reasoning
from engine.api.parse import EngineInfo, EngineRequest
from engine.api.text_stream import TextStream

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
MASKED_LOGPROB = -9999.0   # what -inf (a masked token) is written as, vLLM's value


def usage(prompt_len: int, output_len: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": output_len, "total_tokens": prompt_len + output_len}


def finite(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (and NaN, which a broken row could give) -> -9999.0."""
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB


class _Reply:
    def __init__(self, info: EngineInfo, request: EngineRequest, base: dict) -> None:
        self.info, self.request, self.index = info, request, request.index
        self.base = base                    # id, created, model: shared by the request's choices
        hidden = frozenset(request.sampling["stop_token_ids"]) | info.eos_ids
        self.text = TextStream(info.tokenizer.decode, request.features.stop_strings, hidden)
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None
        self.token_ids: list[int] = []
        self.ended: Ended | None = None

    def _chunk_base(self) -> dict:
        return {**self.base, "object": self.CHUNK_OBJECT}

    def keep(self, item: Tokens) -> str:
        """Take a batch of tokens; returns the text that became certain (the streamed delta)."""
        self.token_ids += item.token_ids
        self.logprobs += item.logprobs
        if item.prompt_logprobs is not None:   # with the first batch, when the prompt's were asked for
            self.prompt_logprobs = item.prompt_logprobs
        return self.text.push(item.token_ids)

    def end(self, item: Ended) -> None:
        """The request ended (a whole response reads ``choice()`` next)."""
        self.ended = item

    @property
    def output_len(self) -> int:
        assert self.ended is not None
        return 0 if self.request.hide_output else self.ended.output_len

    def finish_reason(self) -> str:
        assert self.ended is not None
        if self.request.hide_output:
            return "length"    # max_tokens 0: the prompt alone
        return FINISH_REASONS.get(self.ended.finish_reason or "", self.ended.finish_reason or "stop")

    def _top(self, top: list[tuple[int, float]]) -> list[dict]:
        out = []
        for token, logprob in top:
            name, raw = self.info.token_name(token)
            out.append({"token": name, "logprob": finite(logprob), "bytes": raw})
        return out


class CompletionReply(_Reply):
    CHUNK_OBJECT = "text_completion"

    def __init__(self, info: EngineInfo, request: EngineRequest, base: dict) -> None:
        super().__init__(info, request, base)
        self._chars = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = 0                    # characters of the reply's text before the next token
        self._echoed = False

    def _logprobs(self, tokens: list[int], logprobs: list) -> dict | None:
        """Legacy logprobs of ``tokens`` (each with its (logprob, top) or None), offsets running on."""
        if self.request.features.logprobs is None:
            return None
        names, values, tops, offsets = [], [], [], []
        for token, entry in zip(tokens, logprobs):
            name, raw = self.info.token_name(token)
            names.append(name)
            offsets.append(self._offset)
            self._offset += len(self._chars.decode(bytes(raw)))
            if entry is None:            # the echoed prompt's first token: nothing predicts it
                values.append(None)
                tops.append(None)
                continue
            logprob, top = entry
            values.append(finite(logprob))
            # The legacy map is keyed by name; names differ whenever bytes differ (see module doc).
            tops.append({self.info.token_name(t)[0]: finite(v) for t, v in top})
        return {"tokens": names, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echo(self) -> tuple[str, dict | None]:
        """The echoed prompt's text and logprobs, once (the first chunk, or the whole response)."""
        if self.request.echo is None or self._echoed:
            return "", None
        self._echoed = True
        if self.request.features.logprobs is None:
            self._offset = len(self.request.echo)
            return self.request.echo, None
        entries = [None] + list(self.prompt_logprobs or [])[:len(self.request.prompt_tokens) - 1]
        return self.request.echo, self._logprobs(self.request.prompt_tokens, entries)

    def on_tokens(self, item: Tokens) -> list[dict]:
        delta = self.keep(item)
        echo, echo_logprobs = self._echo()
        if self.request.hide_output:
            return [self._chunk(echo, echo_logprobs)] if echo else []
        delta = echo + delta
        logprobs = _joined(echo_logprobs, self._logprobs(item.token_ids, item.logprobs))
        if not delta and logprobs is None:
            return []
        return [self._chunk(delta, logprobs)]

    def _chunk(self, text: str, logprobs: dict | None, finish_reason: str | None = None) -> dict:
        return {**self._chunk_base(), "choices": [{"index": self.index, "text": text, "logprobs": logprobs,
                                                   "finish_reason": finish_reason}]}

    def on_end(self, item: Ended) -> list[dict]:
        self.ended = item
        echo, echo_logprobs = self._echo()
        tail = "" if self.request.hide_output else self.text.finish()
        return [self._chunk(echo + tail, echo_logprobs, self.finish_reason())]

    def choice(self) -> dict:
        """The whole choice (after ``keep`` of every batch and ``end``; not after streaming)."""
        echo, echo_logprobs = self._echo()
        if self.request.hide_output:
            text, logprobs = echo, echo_logprobs
        else:
            text = echo + self.text.full_text()
            logprobs = _joined(echo_logprobs, self._logprobs(self.token_ids, self.logprobs))
        return {"index": self.index, "text": text, "finish_reason": self.finish_reason(), "logprobs": logprobs}


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the output's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


class ChatReply(_Reply):
    CHUNK_OBJECT = "chat.completion.chunk"

    def __init__(self, info: EngineInfo, request: EngineRequest, base: dict) -> None:
        super().__init__(info, request, base)
        self.thinking = request.features.enable_thinking
        self.sent_reasoning = ""
        self.sent_content = ""
        self.started = False

    def _logprobs(self, tokens: list[int], logprobs: list) -> dict | None:
        if self.request.features.logprobs is None:
            return None
        content = []
        for token, (lp, top) in zip(tokens, logprobs):
            name, raw = self.info.token_name(token)
            content.append({"token": name, "logprob": finite(lp), "bytes": raw, "top_logprobs": self._top(top)})
        return {"content": content}

    def _chunk(self, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        return {**self._chunk_base(), "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs,
                                                   "finish_reason": finish_reason}]}

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
        self.keep(item)
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

    def choice(self) -> dict:
        parsed = self._parsed()
        message = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning,
                   "tool_calls": parsed.tool_calls}
        choice = {"index": self.index, "message": message, "finish_reason": self._finish_reason(parsed),
                  "logprobs": self._logprobs(self.token_ids, self.logprobs)}
        if parsed.tool_call_errors:
            # Not OpenAI's: says why the text of a (forced) tool call did not become a tool call.
            choice["tool_call_parse_errors"] = parsed.tool_call_errors
        return choice
