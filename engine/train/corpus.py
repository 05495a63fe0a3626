"""Chat tasks -> token sequences for training: the prompt as the chat template renders it, then
the reply as the model must write it, packed into sequences of a fixed length.

The loss counts the reply's tokens only (the prompt is given at serving time, never written).
With thinking on the template's prompt ends in ``<think>\\n`` and the reply is the thought,
``\\n</think>``, then the answer; a JSON answer or a tool call sometimes follows ``</think>`` at
once, as the grammar that starts there makes it (engine/grammar/matcher.py: no newline first).

Some thoughts carry slips (engine/train/slips.py): a word of a known kind (a name, city, topic, list
item, tool name or number, mostly restated from the question) swapped for another of its kind, left
out of the loss. The model never learns to slip;
it learns to go on after one, copying from the question again and closing the thought. Sampled at
temperature 0.7, a tiny model does slip, and without this it wandered off and never wrote
``</think>`` (bench/chat_model.py).
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from engine.api.chat_template import BUILTIN_QWEN35_TEMPLATE, ChatTemplate
from engine.model.tokenizer import EOS, IM_END, build_byte_tokenizer
from engine.train.slips import SLIP_SHARE, with_slip
from engine.train.tasks import KIND_TEXT, ChatTask, draw_task

TEMPLATE = BUILTIN_QWEN35_TEMPLATE


@dataclass
class Sequence:
    tokens: list[int]     # [L]
    targets: list[bool]   # [L]: tokens[i] is a reply token the model is trained to predict


class ChatCorpus:
    """Seeded stream of packed training sequences (one ``random.Random`` for the whole stream).

    A sequence holds whole examples, as many as fit in ``max_len`` tokens (at least one): every
    sequence starts at a prompt and no reply is cut.
    """

    def __init__(self, seed: int, max_len: int):
        self.rng = random.Random(f"tiny-chat:{seed}")
        self.max_len = max_len
        self.template = ChatTemplate(TEMPLATE, origin="builtin qwen3.5")
        self.tokenizer = build_byte_tokenizer()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, task: ChatTask) -> str:
        return self.template.render(task.messages + task.history, task.tools, enable_thinking=task.thinking)

    def reply(self, task: ChatTask) -> list[tuple[str, bool]]:
        """The reply as (text, trained) segments."""
        # <|im_end|> closes the turn (the API's stop token); <|endoftext|> after it ends a
        # generation that does not stop at the turn's end (the model's EOS).
        if not task.thinking:
            return [(task.reply + IM_END + EOS, True)]
        tight = task.kind != KIND_TEXT and self.rng.random() < 0.35
        thought = with_slip(self.rng, task.thought) if self.rng.random() < SLIP_SHARE else [(task.thought, True)]
        return [*thought, (f"\n</think>{'' if tight else chr(10) * 2}{task.reply}{IM_END}{EOS}", True)]

    def example(self) -> tuple[list[int], list[bool]]:
        task = draw_task(self.rng)
        tokens = self.encode(self.prompt(task))
        targets = [False] * len(tokens)
        for text, trained in self.reply(task):
            ids = self.encode(text)  # byte tokens, no merges: segments encode as the whole does
            tokens += ids
            targets += [trained] * len(ids)
        return tokens, targets

    def __iter__(self) -> Iterator[Sequence]:
        pending = self.example()
        while True:
            tokens, targets = list(pending[0]), list(pending[1])
            pending = self.example()
            while len(tokens) + len(pending[0]) <= self.max_len:
                tokens += pending[0]
                targets += pending[1]
                pending = self.example()
            yield Sequence(tokens, targets)
