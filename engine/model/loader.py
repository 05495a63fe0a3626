"""Load a Qwen3.5 model from a local HF-format directory (config.json + safetensors + tokenizer.json)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ConfigError, ModelConfig
from engine.model.kimi_config import MODEL_TYPE as KIMI_MODEL_TYPE, KimiConfig
from engine.model.errors import CheckpointError  # noqa: F401  (raised here, imported from here by callers)
from engine.model.mtp import attach_mtp
from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.tokenizer import Tokenizer, load_tokenizer
from engine.model.vision import attach_vision
from engine.model.vision_config import read_vision_config

INDEX_FILE = "model.safetensors.index.json"


def read_config(directory: Path) -> ModelConfig | KimiConfig:
    path = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
        raise CheckpointError(f"{path}: missing (the directory holds {found})")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    try:
        if isinstance(raw, dict) and raw.get("model_type") == KIMI_MODEL_TYPE:
            return KimiConfig.from_hf_dict(raw, source=str(path))
        return ModelConfig.from_hf_dict(raw, source=str(path))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


def read_vision(directory: Path):
    """The checkpoint's ``VisionConfig`` (engine/model/vision_config.py), None for a text-only one."""
    path = directory / "config.json"
    try:
        return read_vision_config(json.loads(path.read_text()), source=str(path))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


def _weight_files(directory: Path) -> dict[str, Path]:
    """Map each stored tensor name to the safetensors file that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: unreadable weight_map ({err})") from None
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                tensor = next(name for name, file in weight_map.items() if file == shard)
                raise CheckpointError(f"{directory / shard}: missing shard (listed in {INDEX_FILE} for "
                                      f"tensor {tensor})")
        return {name: directory / shard for name, shard in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                names[name] = file
    return names


def _language_model_prefix(stored: dict[str, Path], directory: Path) -> str:
    """The prefix in front of ``embed_tokens.weight`` (``model.`` or ``model.language_model.``...)."""
    candidates = sorted((name[: -len("embed_tokens.weight")] for name in stored
                         if name.endswith("embed_tokens.weight")), key=len)
    if not candidates:
        raise CheckpointError(f"{directory}: missing tensor model.embed_tokens.weight")
    return candidates[0]


MTP_PREFIX = "mtp."  # real Qwen3.5 checkpoints keep the MTP module at the top level, beside model.*


def _attach_mtp_if_stored(model: Qwen35ForCausalLM, stored: dict[str, Path]) -> None:
    """Attach the MTP module when config.json asks for one and the checkpoint holds ``mtp.*`` tensors.

    Without any ``mtp.*`` tensor the model has no head (``mtp_absent_reason`` says why, and the
    engine refuses ``speculation=mtp`` with it); with some, every one must be there (load_weights
    names the first missing or mis-shaped tensor).
    """
    layers = model.config.mtp_num_hidden_layers
    # With a vision tower the head drafts on the plain positions and the placeholder tokens' own
    # embeddings (not the tower's rows or M-RoPE): weaker drafts after an image, never wrong ones
    # (the main model verifies every draft); text-only requests draft exactly as without a tower.
    if not layers:
        model.mtp_absent_reason = "config.json declares no MTP module (mtp_num_hidden_layers = 0)"
    elif not any(name.startswith(MTP_PREFIX) for name in stored):
        model.mtp_absent_reason = (f"config.json declares mtp_num_hidden_layers = {layers} but the checkpoint "
                                   "holds no mtp.* tensors")
    else:
        attach_mtp(model)


VISION_PREFIXES = ("model.visual.", "visual.")  # transformers' layout, then a bare one


def _vision_prefix(stored: dict[str, Path], directory: Path) -> str:
    """Where the checkpoint keeps the vision tower (the prefix in front of ``patch_embed.proj.weight``)."""
    for prefix in VISION_PREFIXES:
        if prefix + "patch_embed.proj.weight" in stored:
            return prefix
    raise CheckpointError(f"{directory}: config.json has a vision_config but the checkpoint holds no "
                          f"model.visual.patch_embed.proj.weight")


def _stored_name(name: str, prefix: str, vision_prefix: str = "") -> str:
    """The checkpoint's name for one of our parameters (``prefix`` replaces our ``model.``,
    ``vision_prefix`` our ``visual.``)."""
    if name.startswith("visual."):
        return vision_prefix + name[len("visual."):]
    return prefix + name[len("model."):] if name.startswith("model.") else name


def load_weights(model: Qwen35ForCausalLM, directory: Path) -> None:
    stored = _weight_files(directory)
    prefix = _language_model_prefix(stored, directory)
    vision_prefix = _vision_prefix(stored, directory) if getattr(model, "visual", None) is not None else ""
    _attach_mtp_if_stored(model, stored)
    expected = model.state_dict()
    tied = model.config.tie_word_embeddings
    handles: dict[Path, object] = {}

    def read(stored_name: str) -> torch.Tensor | None:
        file = stored.get(stored_name)
        if file is None:
            return None
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        try:
            return handles[file].get_tensor(stored_name)
        except Exception as err:  # safetensors raises its own error types for broken files
            raise CheckpointError(f"{file}: cannot read tensor {stored_name} ({err})") from None

    # A model may assemble some tensors itself (the MoE model: its experts' slice, per-expert layouts).
    custom = getattr(model, "read_checkpoint_tensor", None)
    try:
        for name, target in expected.items():
            if tied and name == "lm_head.weight":
                continue  # shares storage with embed_tokens
            stored_name = _stored_name(name, prefix, vision_prefix)
            try:
                tensor = custom(stored_name, read) if custom is not None else None
            except ConfigError as err:
                raise CheckpointError(f"{directory}: {err}") from None
            if tensor is None:
                tensor = read(stored_name)
            if tensor is None:
                raise CheckpointError(f"{directory}: missing tensor {stored_name}")
            file = stored.get(stored_name, directory)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{file}: tensor {stored_name} has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
    finally:
        handles.clear()


def load_model(name_or_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", ep_rank: int = 0,
               ep_size: int = 1) -> tuple[Qwen35ForCausalLM, ModelConfig, Tokenizer | None]:
    """Load ``tiny`` / ``tiny-moe`` (embedded, created on first use) or a checkpoint directory.

    ``ep_rank`` / ``ep_size``: which share of a MoE model's experts this process holds.
    """
    from engine.model.embedded import checkpoint_dir_of
    directory = checkpoint_dir_of(str(name_or_dir))
    config = read_config(directory)
    model = _build(config, directory, ep_rank, ep_size)
    vision = read_vision(directory)
    if vision is not None:
        attach_vision(model, vision)
    load_weights(model, directory)
    model.to(device=device, dtype=dtype).eval()
    model.fuse()
    tokenizer = load_tokenizer(directory)
    if tokenizer is not None:
        tokenizer.assign_special_ids(model)
    return model, config, tokenizer


def _build(config: ModelConfig | KimiConfig, directory: Path, ep_rank: int, ep_size: int) -> Qwen35ForCausalLM:
    if isinstance(config, KimiConfig):
        from engine.model.kimi_linear import KimiLinearForCausalLM
        if ep_size > 1 and not config.is_moe:
            raise CheckpointError(f"{directory}: expert parallelism needs sparse MLP layers (mlp_layer_types "
                                  f"has none)")
        try:
            return KimiLinearForCausalLM(config, ep_rank, ep_size)
        except ConfigError as err:
            raise CheckpointError(f"{directory}: {err}") from None
    if not config.is_moe:
        if ep_size > 1:
            raise CheckpointError(f"{directory}: expert parallelism needs a mixture-of-experts checkpoint "
                                  f"(config.json has no num_experts)")
        return Qwen35ForCausalLM(config)
    from engine.model.qwen3_5_moe import Qwen35MoeForCausalLM
    try:
        return Qwen35MoeForCausalLM(config, ep_rank, ep_size)
    except ConfigError as err:
        raise CheckpointError(f"{directory}: {err}") from None
