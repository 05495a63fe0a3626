"""The request bodies the API accepts, as pydantic models (OpenAI's field names and ranges).

Strict types: ``"max_tokens": "10"`` is a 400 naming ``max_tokens``, not a silent cast; NaN
and infinities are refused. Unknown fields are ignored, as OpenAI-compatible servers do
(clients send ``user``, ...), except the ones OpenAI or vLLM define and this server does not
honour: those are a 400 naming them unless they carry their neutral value (``unsupported.py``).
Adding a field is two steps: declare it here, map it in ``parse.py``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError  # noqa: F401 (re-exported)

from engine.scheduler.request_features import MAX_LOGPROBS, MAX_STOP_STRINGS


MAX_N = 16                # choices per prompt (n); each is an engine request
MAX_PROMPTS = 16          # prompts in one completion request (a list of prompts)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TopBody(Body):
    """A whole request body: the fields it does not declare are kept (``model_extra``) so
    ``unsupported.py`` can refuse the ones that would otherwise be silently ignored."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """The extension object (vLLM's): exactly one of json (a schema), regex, choice, grammar (Lark)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool | None = None           # ours: refuse unsupported schema keywords instead of ignoring them
    max_string_length: int | None = Field(None, ge=1)   # ours: bound every string the schema leaves free


class SamplingFields(TopBody):
    """The sampling fields both endpoints share."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                    # -1 or 0: off (vLLM's convention)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)               # choices per prompt, each its own engine request
    logit_bias: dict[str, float] | None = None      # token id (as text) -> bias in [-100, 100]
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)           # vLLM's (1 = off)
    response_format: ResponseFormat | None = None   # structured output (engine/api/structured.py)
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)       # 0 only with echo: the prompt alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str                          # a base64 data URL (remote URLs are refused: no network)
    detail: str | None = None         # accepted and ignored: the checkpoint's pixel range decides


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageURL


class Message(Body):
    role: str = Field(min_length=1)   # any role reaches the template (vLLM's rule); the template decides
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, image_text=None) -> str:
        """The content as text; each image part becomes ``image_text(part)`` (engine/api/images.py)."""
        if isinstance(self.content, list):
            return "".join(part.text if isinstance(part, TextPart) else image_text(part) for part in self.content)
        return self.content or ""


class FunctionDef(Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None        # absent: the function takes no arguments ({})
    strict: bool | None = None                      # true: refuse unsupported schema keywords


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(Body):
    model_config = ConfigDict(strict=True, extra="allow")   # passed on to the template
    enable_thinking: bool = False


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


def stop_list(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list (OpenAI takes a string or a list)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return stops[:MAX_STOP_STRINGS + 1]   # one too many still reaches the features check
