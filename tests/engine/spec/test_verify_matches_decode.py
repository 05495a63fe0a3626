"""A speculative verify's rows attend as decode steps do (the decode kernel, row by row), so a speculative
run's greedy tokens equal a plain run's bit for bit in bf16 too. Found on the trained tiny-chat-moe: SDPA
over the verify segment rounded differently and flipped a near-tied token of the chat workload's 16th
request at its 102nd token (``bench/chat_model.py``: greedy = off was False for ngram, mtp and self)."""
from __future__ import annotations

import pytest
import torch

from engine.api.chat_template import ChatTemplate
from engine.cli.generate import generate, generate_speculative
from engine.model.embedded import checkpoint_dir_of
from engine.model.loader import load_model
from engine.scheduler.sampling import SamplingParams
from engine.workload.chat import ChatWorkload


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def moe_and_prompt(request):
    directory = checkpoint_dir_of("tiny-chat-moe")
    model, _, tokenizer = load_model(directory, dtype=getattr(torch, request.param))
    workload = ChatWorkload(tokenizer=tokenizer, template=ChatTemplate.for_checkpoint(directory), num_requests=16,
                            seed=0)
    return model, tokenizer, list(workload.requests()[15].prompt_tokens)


@pytest.mark.parametrize("kind", ["mtp", "ngram", "self"])
def test_speculation_keeps_the_plain_greedy_tokens_past_a_near_tie(moe_and_prompt, kind):
    model, tokenizer, prompt = moe_and_prompt
    params = lambda: SamplingParams(temperature=0.0, max_tokens=110)  # noqa: E731
    with torch.no_grad():
        plain = generate(model, tokenizer, prompt, params())
        drafted = generate_speculative(model, tokenizer, prompt, params(), kind, 2)
    assert drafted["tokens"] == plain["tokens"] and drafted["spec"]["accepted"] > 0
