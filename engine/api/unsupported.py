"""Request fields OpenAI or vLLM define that this server does not honour: a 400 naming each.

Unknown fields are ignored (clients send ``user``, ``metadata``, ...), but a field that
would change the output must act or be refused, never be dropped silently. Each entry is
the field, the values that mean "off" (sent by clients that spell out defaults: those pass)
and what to use instead. Pure: the handlers call ``refuse`` with the body's extra fields.
"""
from __future__ import annotations

from typing import Any

from engine.api.errors import bad_request

_OFF_NONE = (None,)
_STRUCTURED = "use structured_outputs (json, regex, choice, grammar) or response_format"

# field -> (values that mean off, what the client can do instead)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "vLLM v1 removed best_of; ask for n choices and rank them yourself"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "length_penalty only applies to beam search, which is not implemented"),
    "suffix": ((None, ""), "insertion (suffix) is not implemented"),
    "prompt_logprobs": (_OFF_NONE, "use echo with logprobs on /v1/completions"),
    "allowed_token_ids": (_OFF_NONE, "use logit_bias or structured_outputs"),
    "bad_words": ((None, []), "use logit_bias with -100 on the words' tokens"),
    "ignore_eos": ((None, False), "use min_tokens (EOS cannot end the output before it)"),
    "include_stop_str_in_output": ((None, False), "stop strings are always cut from the text"),
    "logits_processors": (_OFF_NONE, "custom logits processors are not supported"),
    "truncate_prompt_tokens": (_OFF_NONE, "send a prompt that fits the context"),
    "guided_json": (_OFF_NONE, _STRUCTURED),
    "guided_regex": (_OFF_NONE, _STRUCTURED),
    "guided_choice": (_OFF_NONE, _STRUCTURED),
    "guided_grammar": (_OFF_NONE, _STRUCTURED),
    "guided_decoding_backend": (_OFF_NONE, _STRUCTURED),
    "guided_whitespace_pattern": (_OFF_NONE, _STRUCTURED),
    "functions": (_OFF_NONE, "use tools"),
    "function_call": (_OFF_NONE, "use tool_choice"),
    "prediction": (_OFF_NONE, "predicted outputs are not implemented"),
    "audio": (_OFF_NONE, "this model has no audio output"),
    "modalities": ((None, ["text"]), "this model writes text only"),
    "continue_final_message": ((None, False), "continuing the last assistant message is not implemented"),
    "add_generation_prompt": ((None, True), "the assistant turn is always opened"),
    "chat_template": (_OFF_NONE, "the checkpoint's own chat template is used"),
    "documents": (_OFF_NONE, "documents are not passed to the template"),
    "mm_processor_kwargs": (_OFF_NONE, "this model takes text only"),
    "return_tokens_as_token_ids": ((None, False), "tokens are named by their text (or bytes:...)"),
    "priority": ((None, 0), "requests are served first come, first served"),
}
CHAT_ONLY = {"echo": ((None, False), "chat echo (the last message repeated) is not implemented")}


def refuse(extra: dict[str, Any] | None, *, chat: bool) -> None:
    """A 400 naming the first field of ``extra`` (a body's undeclared fields) that is set but not honoured."""
    table = {**REFUSED, **CHAT_ONLY} if chat else REFUSED
    for name, value in (extra or {}).items():
        entry = table.get(name)
        if entry is None:
            continue
        off, instead = entry
        if value in off:
            continue
        raise bad_request(f"{name}: not supported by this server ({instead}); got {value!r:.80}", name,
                          "unsupported_parameter")
