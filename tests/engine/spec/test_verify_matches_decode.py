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


@pytest.mark.parametrize("kind", ["mtp", "ngram", "self"])
def test_with_a_quantized_cache_verify_rows_take_decodes_gathered_path_too(kind):
    """InnerQ-8 K/V: no native kernel, decode gathers and runs SDPA per row; verify rows do the same. On
    SDPA over the segment, tiny-chat's 17th chat request in bf16 left the plain tokens at its 16th token."""
    directory = checkpoint_dir_of("tiny-chat")
    model, _, tokenizer = load_model(directory, dtype=torch.bfloat16)
    workload = ChatWorkload(tokenizer=tokenizer, template=ChatTemplate.for_checkpoint(directory), num_requests=17,
                            seed=0)
    prompt, kv_cache = list(workload.requests()[16].prompt_tokens), {"kv_cache_dtype": "innerq8"}
    params = lambda: SamplingParams(temperature=0.0, max_tokens=40)  # noqa: E731
    with torch.no_grad():
        plain = generate(model, tokenizer, prompt, params(), kv_cache=kv_cache)
        drafted = generate_speculative(model, tokenizer, prompt, params(), kind, 2, kv_cache=kv_cache)
    assert drafted["tokens"] == plain["tokens"]
