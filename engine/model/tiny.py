"""The embedded default model ``tiny``: a seeded random Qwen3.5 checkpoint written once to a cache dir.

It is a real HF-format checkpoint (config.json, model.safetensors, tokenizer.json) loaded
through the same loader as any other, sized so batch-8 decode on 2 CPU cores takes a few ms.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.mtp import attach_mtp
from engine.model.mtp_train import DistillSettings, distill
from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.tokenizer import CHAT_TOKENS, EOS, SPECIAL_TOKENS, build_byte_tokenizer

TINY_VERSION = 4  # bump when the config or the init changes, so caches are rebuilt
TINY_SEED = 1234
TINY_CONFIG = ModelConfig(
    vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, tie_word_embeddings=False, eos_token_id=256, mtp_num_hidden_layers=1,
)
TINY_MTP = DistillSettings(seed=TINY_SEED)  # the MTP layer's self-distillation (engine/model/mtp_train.py)
MARKER = "chunkscope_tiny.json"


def cache_root() -> Path:
    return Path(os.environ.get("CHUNKSCOPE_CACHE") or Path.home() / ".cache" / "chunkscope").expanduser()


def random_init(model: Qwen35ForCausalLM, seed: int) -> None:
    """Seeded weights with the statistics of a trained model's init (small GEMMs, varied norms/decays)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1.0, 16.0, generator=generator).log())
            elif name.endswith("dt_bias"):
                param.copy_(torch.ones(param.shape) + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def perturb_parameters(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Perturb every parameter, norms included (HF inits them to constants that would hide bugs):
    the parity tests' weights, which the benches that compare against them reuse."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.5, 8.0, generator=generator).log())
            elif param.dim() == 1:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))


def train_tiny_mtp(model: Qwen35ForCausalLM) -> list[float]:
    """The MTP layer: seeded init, then self-distillation on the model's own greedy continuations."""
    mtp = attach_mtp(model)
    random_init(mtp, TINY_SEED + 1)
    return distill(model, mtp, TINY_MTP)


def write_checkpoint(model: Qwen35ForCausalLM, directory: Path) -> None:
    """Save in HF layout; tied LM heads are left out as HF does."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))


def ensure_tiny_checkpoint() -> Path:
    """Return the tiny checkpoint directory, creating it on first use (atomically)."""
    return ensure_cached_checkpoint("tiny", MARKER, _marker(), _build_tiny)


def _build_tiny() -> Qwen35ForCausalLM:
    torch.manual_seed(TINY_SEED)
    model = Qwen35ForCausalLM(TINY_CONFIG)
    random_init(model, TINY_SEED)
    train_tiny_mtp(model)
    return model


def _marker() -> dict:
    """What the cached checkpoint was built from: a change to any of it rebuilds the cache."""
    return {"version": TINY_VERSION, "seed": TINY_SEED, "eos": EOS, "special_tokens": tokenizer_tokens(),
            "config": TINY_CONFIG.to_hf_dict(), "mtp": TINY_MTP.to_dict()}


def tokenizer_tokens() -> list[str]:
    """The special tokens of the embedded tokenizer: part of every embedded checkpoint's marker."""
    return [*SPECIAL_TOKENS, *CHAT_TOKENS]


def ensure_cached_checkpoint(name: str, marker_name: str, marker: dict,
                             build: Callable[[], Qwen35ForCausalLM],
                             write: Callable[[Qwen35ForCausalLM, Path], None] | None = None,
                             tokenizer: Callable[[], object] = build_byte_tokenizer) -> Path:
    """``cache_root() / name``, built by ``build`` on first use or when its marker differs from ``marker``.

    ``write`` saves the model (``write_checkpoint``), ``tokenizer`` builds its tokenizer.
    Written to a staging directory and moved into place, so a reader never sees half a checkpoint;
    a process that loses the race to another (an expert-parallel rank) keeps the winner's copy.
    """
    directory = cache_root() / name
    marker_path = directory / marker_name
    if _marker_matches(marker_path, marker):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=directory.parent))
    try:
        (write or write_checkpoint)(build(), staging)
        tokenizer().save(str(staging / "tokenizer.json"))
        (staging / marker_name).write_text(json.dumps(marker))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except OSError:
        # Another process may have won the race to create it; its checkpoint is identical.
        if not _marker_matches(marker_path, marker):
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def _marker_matches(path: Path, marker: dict) -> bool:
    try:
        return json.loads(path.read_text()) == marker
    except (OSError, ValueError):
        return False
