"""The training corpus: seeded, whole examples, loss on replies only, replies that follow the rules."""
from __future__ import annotations

import itertools
import json
import random
import re

import jsonschema

from engine.api.output_parse import parse_reply
from engine.model.tokenizer import EOS, IM_END
from engine.train.corpus import ChatCorpus
from engine.train.slips import MAX_SLIPS
from engine.train.tasks import KIND_JSON, KIND_TOOL, TOOL_BY_NAME, draw_task


def test_the_same_seed_gives_the_same_sequences_and_another_seed_others():
    first = [(s.tokens, s.targets) for s in itertools.islice(ChatCorpus(5, 1024), 4)]
    again = [(s.tokens, s.targets) for s in itertools.islice(ChatCorpus(5, 1024), 4)]
    other = [(s.tokens, s.targets) for s in itertools.islice(ChatCorpus(6, 1024), 4)]
    assert first == again and first != other


def test_sequences_hold_whole_examples_starting_at_a_prompt_with_loss_on_replies_only():
    corpus = ChatCorpus(0, 1024)
    im_start, im_end, eos = (corpus.tokenizer.token_to_id(t) for t in ("<|im_start|>", IM_END, EOS))
    for sequence in itertools.islice(corpus, 12):
        assert sequence.tokens[0] == im_start and not sequence.targets[0]
        assert sequence.tokens[-2:] == [im_end, eos] and all(sequence.targets[-2:])
        assert len(sequence.tokens) <= 1024 or sequence.tokens.count(eos) == 1   # one long example alone
        # Every reply ends the turn (<|im_end|> then <|endoftext|>) before the next prompt; the other
        # untrained stretches inside a reply are copy slips (test_slips.py).
        ends = [i for i in range(1, len(sequence.targets))
                if sequence.targets[i - 1] and not sequence.targets[i] and sequence.tokens[i] == im_start]
        assert all(sequence.tokens[i - 2:i] == [im_end, eos] for i in ends)


def test_replies_close_the_thought_and_their_calls_and_json_validate():
    corpus = ChatCorpus(1, 1024)
    rng = random.Random(3)
    kinds = set()
    for _ in range(60):
        task = draw_task(rng)
        reply = "".join(text for text, _ in corpus.reply(task))
        assert reply.endswith(IM_END + EOS)
        text = reply.removesuffix(IM_END + EOS)
        parsed = parse_reply(text, thinking=task.thinking, tools_allowed=task.tools is not None)
        if task.thinking:  # the thought, but for at most MAX_SLIPS words swapped for others of their kind
            assert "</think>" in text
            said, meant = parsed.reasoning.split(" "), task.thought.split(" ")
            swaps = [(a, b) for a, b in zip(said, meant) if a != b]
            assert len(said) == len(meant) and len(swaps) <= MAX_SLIPS
            assert all(re.sub(r"\w+", "", a) == re.sub(r"\w+", "", b) for a, b in swaps)   # punctuation kept
        if task.kind == KIND_TOOL and task.tool_call is not None:
            (call,) = parsed.tool_calls
            schema = TOOL_BY_NAME[call["function"]["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            assert json.loads(call["function"]["arguments"]) == task.tool_call["arguments"]
        if task.kind == KIND_JSON:
            jsonschema.validate(json.loads(parsed.content), task.schema)
        kinds.add(task.kind)
    assert kinds == {"text", "tool", "json"}
