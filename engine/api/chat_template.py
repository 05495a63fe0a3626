"""Chat messages -> prompt text: the checkpoint's own Jinja template, else a built-in Qwen3.5 one.

The checkpoint's template comes from ``chat_template.jinja`` or ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates: ``default`` is used), and is
rendered as transformers renders it: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, ``tojson`` and ``raise_exception``. Tool-call arguments that arrive as JSON
strings (OpenAI's form) are handed to the template as mappings, as Qwen's templates expect.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Qwen3.5's conventions: ChatML turns (any role other than assistant and tool, custom ones
# included, is a turn of its own name), a think block opening the assistant's reply, tools
# listed as JSON in the system turn and called in the XML form.
BUILTIN_QWEN35_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n'
    '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n'
    '</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role not in ('assistant', 'tool') %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}
{{- message.content }}
{%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>\n<function=' + call.function.name + '>\n' }}
{%- if call.function.arguments is mapping %}
{%- for name, value in call.function.arguments | items %}
{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
{%- endfor %}
{%- else %}{{- call.function.arguments + '\n' }}
{%- endif %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its own ``raise_exception`` or a Jinja error)."""


def load_checkpoint_template(directory: Path) -> str | None:
    """The checkpoint's chat template text, or None when it ships none."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    """A compiled template; ``render`` gives the prompt text for messages (+ tools)."""

    def __init__(self, source: str, *, origin: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self.origin = origin
        self._template = env.from_string(source)

    @classmethod
    def for_checkpoint(cls, directory: Path | None) -> "ChatTemplate":
        source = load_checkpoint_template(directory) if directory is not None else None
        if source is None:
            return cls(BUILTIN_QWEN35_TEMPLATE, origin="builtin qwen3.5")
        return cls(source, origin=f"checkpoint {directory}")

    def render(self, messages: list[dict], tools: list[dict] | None, *, enable_thinking: bool,
               extra: dict[str, Any] | None = None) -> str:
        try:
            return self._template.render(messages=[_mapped_arguments(m) for m in messages], tools=tools or None,
                                         add_generation_prompt=True, **(extra or {}),
                                         enable_thinking=enable_thinking)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"chat template ({self.origin}) failed: {exc}") from None


def _mapped_arguments(message: dict) -> dict:
    """An assistant message whose tool-call arguments are JSON text gets them as a mapping."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    mapped = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = arguments
        mapped.append({**call, "function": {**call["function"],
                                            "arguments": parsed if isinstance(parsed, dict) else arguments}})
    return {**message, "tool_calls": mapped}
