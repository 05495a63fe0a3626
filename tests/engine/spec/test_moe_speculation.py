"""Speculation on the MoE model: the verify forward (and self-speculation's early exit) go through
``Qwen35MoeForCausalLM.forward``, whose keywords must reach the dense forward; under expert
parallelism self-speculation is refused (the ranks would run different layers)."""
from __future__ import annotations

import pytest
import torch

from engine.cli.generate import generate, generate_speculative
from engine.model.embedded import checkpoint_dir_of
from engine.model.loader import load_model
from engine.model.qwen3_5_moe import Qwen35MoeForCausalLM
from engine.scheduler.sampling import SamplingParams
from engine.spec.spec_support import speculation_rejection

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]  # greedy, tiny-moe repeats itself: n-gram drafts too


@pytest.fixture(scope="module")
def tiny_moe():
    torch.set_grad_enabled(False)
    return load_model(checkpoint_dir_of("tiny-moe"))


@pytest.mark.parametrize("kind", ["ngram", "self"])
@pytest.mark.parametrize("seed,temperature", [(None, 0.0), (7, 1.0)])
def test_speculation_on_the_moe_model_equals_off(tiny_moe, kind, seed, temperature):
    model, _, tokenizer = tiny_moe
    params = lambda: SamplingParams(temperature=temperature, max_tokens=12, seed=seed)  # noqa: E731
    off = generate(model, tokenizer, PROMPT, params(), stop_at_eos=False)
    spec = generate_speculative(model, tokenizer, PROMPT, params(), kind, 2, stop_at_eos=False)
    assert spec["tokens"] == off["tokens"]
    if kind == "self" or temperature == 0.0:  # a sampled run may never repeat an n-gram
        assert spec["spec"]["steps"] > 0 and spec["spec"]["drafted"] > 0


def test_self_speculation_is_refused_under_expert_parallelism(tiny_moe):
    _, config, _ = tiny_moe
    sharded = Qwen35MoeForCausalLM(config, ep_rank=0, ep_size=2)
    assert speculation_rejection("self", sharded) is not None
    assert speculation_rejection("ngram", sharded) is None
