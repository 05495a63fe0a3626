"""The chat workload: seeded requests in the chat template, each kind with its rules (thinking,
a required tool call's grammar, a JSON schema after the thought), and the serve feed that draws it."""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from engine.api.chat_template import BUILTIN_QWEN35_TEMPLATE, ChatTemplate
from engine.grammar.spec import GrammarSpec
from engine.model.tokenizer import Tokenizer, build_byte_tokenizer
from engine.serve.workload_feed import EPOCH_REQUESTS, WorkloadFeed
from engine.workload.chat import ChatWorkload, task_kind
from engine.workload.request import WorkloadError

TOKENIZER = Tokenizer(build_byte_tokenizer())
TEMPLATE = ChatTemplate(BUILTIN_QWEN35_TEMPLATE, origin="builtin")


def workload(**kw) -> ChatWorkload:
    return ChatWorkload(tokenizer=TOKENIZER, template=TEMPLATE, **kw)


def test_seeded_requests_mix_thinking_tools_and_json_with_their_rules():
    specs = workload(num_requests=80, seed=2).requests()
    assert [s.to_json() for s in specs] == [s.to_json() for s in workload(num_requests=80, seed=2).requests()]
    assert [s.to_json() for s in specs] != [s.to_json() for s in workload(num_requests=80, seed=3).requests()]
    im_end, think_end = TOKENIZER.token_id("<|im_end|>"), TOKENIZER.token_id("</think>")
    kinds = {k: [s for s in specs if task_kind(s) == k] for k in ("text", "tool", "json")}
    assert all(len(group) >= 8 for group in kinds.values()), {k: len(v) for k, v in kinds.items()}
    for spec in specs:
        text = TOKENIZER.decode(spec.prompt_tokens)
        thinking = spec.features["enable_thinking"]
        assert text.startswith("<|im_start|>") and spec.sampling["stop_token_ids"] == [im_end]
        # The template opens the thought, or closes an empty one when thinking is off.
        assert text.endswith("<|im_start|>assistant\n<think>\n" if thinking else "<think>\n\n</think>\n\n")
        assert think_end not in spec.prompt_tokens[-3:] or not thinking
        if spec.grammar is not None:
            parsed = GrammarSpec.parse(spec.grammar)
            assert parsed.after_think == thinking
    for spec in kinds["tool"]:
        assert spec.grammar["kind"] == "lark" and "<tools>" in TOKENIZER.decode(spec.prompt_tokens)
    for spec in kinds["json"]:
        assert spec.grammar["kind"] == "json_schema" and "JSON" in TOKENIZER.decode(spec.prompt_tokens)
    assert 0.3 < sum(s.features["enable_thinking"] for s in specs) / len(specs) < 0.7
    assert json.dumps(workload(num_requests=3).describe())   # a run row can store it


def test_bad_options_and_a_tokenizer_without_chat_tokens_are_clear_errors():
    with pytest.raises(WorkloadError, match="tool_share \\+ json_share"):
        workload(tool_share=0.7, json_share=0.5)
    with pytest.raises(WorkloadError, match="thinking_share must be in"):
        workload(thinking_share=2)
    with pytest.raises(WorkloadError, match="chat workload does not take|unexpected keyword"):
        workload(prompt_len_median=3)
    bare = SimpleNamespace(token_id=lambda text: None)
    with pytest.raises(WorkloadError, match="needs a tokenizer with <\\|im_end\\|>"):
        ChatWorkload(tokenizer=bare, template=TEMPLATE)


def test_the_serve_feed_draws_chat_epochs_or_a_limited_run():
    setup = SimpleNamespace(tokenizer=TOKENIZER, checkpoint_dir=None, model_name="tiny-chat")
    args = SimpleNamespace(workload="chat", requests=None, rate=50.0, seed=1)
    specs = list(itertools.islice(WorkloadFeed.from_args(args, setup).due(float("inf")), EPOCH_REQUESTS + 2))
    assert [s.request_id for s in specs] == list(range(EPOCH_REQUESTS + 2))
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    limited = WorkloadFeed.from_args(SimpleNamespace(**{**vars(args), "requests": 4}), setup)
    assert len(list(limited.due(float("inf")))) == 4 and limited.describe()["kind"] == "chat"
    with pytest.raises(WorkloadError, match="needs a model with a tokenizer"):
        WorkloadFeed.from_args(args, SimpleNamespace(tokenizer=None, model_name="x"))
