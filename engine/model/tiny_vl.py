"""The embedded ``tiny-vl`` model: a seeded random Qwen3.5 with a vision tower, written once to a cache dir.

The text part is sized like ``tiny`` (no MTP module); the tower has 2 blocks of width 64 over
8-pixel patches merged 2 x 2, so one placeholder token covers 16 x 16 pixels and an image holds
4 to 64 of them (``preprocessor_config.json``). Written in transformers' layout
(``model.language_model.*``, ``model.visual.*``, a ``qwen3_5`` config.json), so
``Qwen3_5ForConditionalGeneration`` loads it as it is.
"""
from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.tiny import TINY_CONFIG, ensure_cached_checkpoint, random_init, tokenizer_tokens
from engine.model.tokenizer import EOS, VISION_TOKENS, build_byte_tokenizer
from engine.model.vision import attach_vision
from engine.model.vision_config import VisionConfig, wrap_text_config

TINY_VL_VERSION = 1  # bump when the config or the init changes, so caches are rebuilt
TINY_VL_SEED = 5150
# The text part of ``tiny`` without its MTP module (not run with images: docs/vision.md).
TINY_VL_CONFIG = dataclasses.replace(TINY_CONFIG, mtp_num_hidden_layers=0)
# Vision tokens follow the chat tokens of the byte tokenizer: ids 266, 267, 268.
TINY_VL_VISION = VisionConfig(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, num_position_embeddings=64,
    patch_size=8, spatial_merge_size=2, temporal_patch_size=2, vision_start_token_id=266, vision_end_token_id=267,
    image_token_id=268, mrope_section=(2, 1, 1),
)
TINY_VL_PREPROCESSOR = {"size": {"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 64},
                        "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
                        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
MARKER = "chunkscope_tiny_vl.json"


def ensure_tiny_vl_checkpoint() -> Path:
    """Return the tiny-vl checkpoint directory, creating it on first use (atomically)."""
    return ensure_cached_checkpoint("tiny-vl", MARKER, _marker(), _build_tiny_vl, write_vision_checkpoint,
                                    partial(build_byte_tokenizer, VISION_TOKENS))


def _build_tiny_vl() -> Qwen35ForCausalLM:
    torch.manual_seed(TINY_VL_SEED)
    model = Qwen35ForCausalLM(TINY_VL_CONFIG)
    attach_vision(model, TINY_VL_VISION)
    random_init(model, TINY_VL_SEED)
    return model


def write_vision_checkpoint(model: Qwen35ForCausalLM, directory: Path,
                            preprocessor: dict | None = None) -> None:
    """Save a model with a vision tower in transformers' ``*ForConditionalGeneration`` layout."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = wrap_text_config(model.config.to_hf_dict(), model.vision_config)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor or TINY_VL_PREPROCESSOR, indent=2))


def _marker() -> dict:
    return {"version": TINY_VL_VERSION, "seed": TINY_VL_SEED, "eos": EOS,
            "special_tokens": [*tokenizer_tokens(), *VISION_TOKENS],
            "config": wrap_text_config(TINY_VL_CONFIG.to_hf_dict(), TINY_VL_VISION),
            "preprocessor": TINY_VL_PREPROCESSOR}
