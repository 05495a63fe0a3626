"""Fixtures: tiny random Qwen3.5 checkpoints written by transformers' save_pretrained (the oracle)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.tiny import perturb_parameters
from tests.engine.kernel_marks import kernel_variant, one_torch_thread  # noqa: F401  (the kernel tests use them)

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)

CONFIGS = {
    "base": {},
    "tied_mha": dict(num_key_value_heads=4, linear_num_value_heads=2, tie_word_embeddings=True),
    "pattern": dict(num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    layer_types=["full_attention", "linear_attention", "linear_attention",
                                 "full_attention", "linear_attention"]),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Perturb every parameter, norms included (HF inits them to constants that would hide bugs)."""
    perturb_parameters(model, torch.Generator().manual_seed(seed))


def make_hf_model(name: str = "base", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{**BASE, **CONFIGS[name], **overrides})
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize(model, seed)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (config name, seed) -> (HF model, saved directory), cached per session."""
    cache: dict[tuple[str, int], tuple[object, Path]] = {}

    def build(name: str = "base", seed: int = 0):
        key = (name, seed)
        if key not in cache:
            model = make_hf_model(name, seed)
            directory = tmp_path_factory.mktemp(f"hf-{name}-{seed}")
            model.save_pretrained(directory)
            cache[key] = (model, directory)
        return cache[key]

    return build




@pytest.fixture(autouse=True)
def grad_mode_as_a_fresh_process_has_it():
    """Every test starts with autograd on, as a fresh process has it: several engine tests switch it off
    for their module's forwards with ``torch.set_grad_enabled(False)``, which would otherwise reach the
    training tests' backward passes, depending on the order the suite runs in."""
    torch.set_grad_enabled(True)
    yield
    torch.set_grad_enabled(True)
