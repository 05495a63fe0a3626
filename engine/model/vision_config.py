"""The vision part of a Qwen3.5 (dense or MoE) ``config.json``: the tower's shape and the image tokens.

A ``qwen3_5`` / ``qwen3_5_moe`` config holds a ``text_config`` (read by ``config.py``), a
``vision_config`` and the ids of the tokens that frame and stand in for an image. A config
without ``vision_config`` is text only (``read_vision_config`` returns None).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.model.config import ConfigError, _is_int

WRAPPER_TYPES = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForConditionalGeneration"),
                 "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration")}
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' default when rope_parameters has none


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    # The prompt tokens: an image is <vision_start> <image_pad> x N <vision_end>.
    image_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    # M-RoPE: how many of the text rotary's frequencies each of (t, h, w) owns, interleaved.
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                     "num_position_embeddings", "in_channels", "patch_size", "spatial_merge_size",
                     "temporal_patch_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"vision_config field {name} must be a positive integer, got {value!r}")
        for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"config field {name} must be a token id, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"vision_config hidden_size {self.hidden_size} / num_heads {self.num_heads} must "
                              f"give a head dim divisible by 4 (2-D rotary)")
        side = round(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ConfigError(f"vision_config num_position_embeddings {self.num_position_embeddings} is not a "
                              f"square grid")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config hidden_act must be one of {VISION_ACTIVATIONS}, got {self.hidden_act!r}")
        if len(self.mrope_section) != 3 or not all(_is_int(s) and s >= 0 for s in self.mrope_section):
            raise ConfigError(f"rope_parameters.mrope_section must be 3 integers, got {self.mrope_section!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """The learned position grid is grid_side x grid_side."""
        return round(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text token."""
        return self.spatial_merge_size ** 2

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``vision_config`` object of config.json (token ids and M-RoPE live elsewhere in it)."""
        data = asdict(self)
        for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id", "mrope_section"):
            data.pop(name)
        data["rope_parameters"] = {"rope_type": "axial", "rope_theta": data.pop("rope_theta")}
        data["model_type"] = "qwen3_5_vision"
        return data


def read_vision_config(raw: dict[str, Any], source: str = "config.json") -> VisionConfig | None:
    """The vision config of a ``qwen3_5`` / ``qwen3_5_moe`` config.json, or None for a text-only one."""
    if not isinstance(raw, dict) or raw.get("model_type") not in WRAPPER_TYPES or raw.get("vision_config") is None:
        return None
    vision = raw["vision_config"]
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: vision_config must be an object, got {vision!r}")
    kwargs = {name: vision[name] for name in VisionConfig.__dataclass_fields__ if name in vision}
    kwargs["depth"] = vision.get("depth", vision.get("num_hidden_layers"))
    kwargs["num_heads"] = vision.get("num_heads", vision.get("num_attention_heads"))
    rope = vision.get("rope_parameters") or {}
    if "rope_theta" in rope:
        kwargs["rope_theta"] = rope["rope_theta"]
    missing = [name for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                                 "num_position_embeddings") if kwargs.get(name) is None]
    if missing:
        raise ConfigError(f"{source}: vision_config is missing field(s) {', '.join(missing)}")
    for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if name not in raw:
            raise ConfigError(f"{source}: a config with vision_config needs {name}")
        kwargs[name] = raw[name]
    text_rope = (raw.get("text_config") or {}).get("rope_parameters") or {}
    kwargs["mrope_section"] = tuple(text_rope.get("mrope_section", DEFAULT_MROPE_SECTION))
    if text_rope.get("mrope_interleaved") is False:
        raise ConfigError(f"{source}: rope_parameters.mrope_interleaved=false is not supported (Qwen3.5 "
                          f"interleaves its M-RoPE sections)")
    try:
        return VisionConfig(**kwargs)
    except (ConfigError, TypeError) as err:
        raise ConfigError(f"{source}: {err}") from None


def wrap_text_config(text: dict[str, Any], vision: VisionConfig) -> dict[str, Any]:
    """A text ``config.json`` (``ModelConfig.to_hf_dict``) wrapped with its vision config, HF layout."""
    wrapper = next(name for name, (text_type, _) in WRAPPER_TYPES.items() if text_type == text["model_type"])
    text = dict(text)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(vision.mrope_section),
                               "mrope_interleaved": True}
    return {"model_type": wrapper, "architectures": [WRAPPER_TYPES[wrapper][1]], "text_config": text,
            "vision_config": vision.to_hf_dict(), "image_token_id": vision.image_token_id,
            "vision_start_token_id": vision.vision_start_token_id,
            "vision_end_token_id": vision.vision_end_token_id,
            "tie_word_embeddings": text["tie_word_embeddings"], "eos_token_id": text.get("eos_token_id")}
