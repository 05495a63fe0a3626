"""The Qwen3.5 text configuration, read from an HF ``config.json`` and checked."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """config.json describes something this engine cannot run."""


class HybridLayers:
    """The layer pattern of a hybrid config (``layer_types``): which layers are full / linear attention."""

    layer_types: tuple[str, ...]

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


@dataclass(frozen=True)
class ModelConfig(HybridLayers):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    eos_token_id: int | None = None
    max_position_embeddings: int = 32768  # the context admission checks prompts against
    # Qwen3.5-MoE (all four 0 for the dense model): every layer's MLP is a sparse MoE block.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # The multi-token-prediction module (engine/model/mtp.py): how many MTP decoder layers, and
    # whether it has its own embeddings (Qwen3.5 shares the main model's; True is refused).
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    def __post_init__(self):
        if not self.layer_types:
            # Default hybrid pattern: every 4th layer is full attention (3:1).
            types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if not _is_int(self.max_position_embeddings) or self.max_position_embeddings <= 0:
            raise ConfigError(f"config field max_position_embeddings must be a positive integer, "
                              f"got {self.max_position_embeddings!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ConfigError(f"config field {name} must be a positive number, got {value!r}")
        # A string "false" is truthy: it would tie the LM head to the embeddings without a word.
        for name in ("attention_bias", "tie_word_embeddings", "mtp_use_dedicated_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name} must be true or false, got {getattr(self, name)!r}")
        if self.eos_token_id is not None and (not _is_int(self.eos_token_id) or self.eos_token_id < 0):
            raise ConfigError(f"config field eos_token_id must be a token id (an integer >= 0), "
                              f"got {self.eos_token_id!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config field layer_types has {len(self.layer_types)} entries, "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"config field layer_types has unknown layer types {unknown}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("config field num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("config field linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not _is_int(self.mtp_num_hidden_layers) or self.mtp_num_hidden_layers < 0:
            raise ConfigError(f"config field mtp_num_hidden_layers must be an integer >= 0, "
                              f"got {self.mtp_num_hidden_layers!r}")
        if self.mtp_use_dedicated_embeddings:
            raise ConfigError("config field mtp_use_dedicated_embeddings=true is not supported: the MTP "
                              "module here shares the main model's embeddings and LM head")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.is_moe:
            for name in MOE_FIELDS:
                if not _is_int(getattr(self, name)) or getattr(self, name) <= 0:
                    raise ConfigError(f"config field {name} must be a positive integer, got {getattr(self, name)!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"config field num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                  f"num_experts ({self.num_experts})")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"config field partial_rotary_factor gives rotary dim {self.rotary_dim}, "
                              f"which must be even and within head_dim {self.head_dim}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: q, k and v of the fused projection."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``qwen3_5_text`` config.json content for this config."""
        data = asdict(self)
        data["layer_types"] = list(self.layer_types)
        data["rope_parameters"] = {"rope_type": "default", "rope_theta": data.pop("rope_theta"),
                                   "partial_rotary_factor": data.pop("partial_rotary_factor")}
        if self.is_moe:
            data.pop("intermediate_size")  # the MoE config has none: experts and shared expert size their own
            data.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], dtype="float32")
        else:
            for name in MOE_FIELDS:
                data.pop(name)
            data.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], dtype="float32")
        return data

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Read a ``qwen3_5_text`` / ``qwen3_5_moe_text`` config, or the ``text_config`` of a
        ``qwen3_5`` / ``qwen3_5_moe`` one."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must hold a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: unknown architecture model_type={model_type!r}; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        text = raw
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type {model_type!r} needs a text_config object")
            text = {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **text}
        rope = text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"{source}: rope_parameters.rope_type {rope_type!r} is not supported")
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        kwargs: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name in text:
                kwargs[name] = text[name]
        kwargs.pop("eos_token_id", None)
        if "rope_theta" in rope:
            kwargs["rope_theta"] = _float_field(source, "rope_parameters.rope_theta", rope["rope_theta"])
        kwargs["partial_rotary_factor"] = _float_field(
            source, "partial_rotary_factor", rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        if model_type in MOE_MODEL_TYPES:
            missing = [name for name in MOE_FIELDS if name not in kwargs]
            if missing:
                raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
            # Unused by the MoE model (no dense MLP); the shared expert's size keeps the field valid.
            kwargs.setdefault("intermediate_size", kwargs["shared_expert_intermediate_size"])
        else:
            for name in MOE_FIELDS:
                kwargs.pop(name, None)
        missing = [name for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads")
                   if name not in kwargs]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        if "head_dim" not in kwargs:
            hidden, heads = kwargs["hidden_size"], kwargs["num_attention_heads"]
            if not (_is_int(hidden) and _is_int(heads) and heads > 0):
                raise ConfigError(f"{source}: head_dim is absent and cannot be derived from hidden_size "
                                  f"{hidden!r} / num_attention_heads {heads!r} (positive integers)")
            kwargs["head_dim"] = hidden // heads
        if kwargs.get("layer_types") is not None and not isinstance(kwargs["layer_types"], (list, tuple)):
            raise ConfigError(f"{source}: layer_types must be a list, got {kwargs['layer_types']!r}")
        for name, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
                              ("linear_key_head_dim", 128), ("linear_value_head_dim", 128)):
            kwargs.setdefault(name, default)
        if kwargs.get("layer_types") is None:
            interval = text.get("full_attention_interval", 4)
            if not _is_int(interval) or interval <= 0 or not _is_int(kwargs["num_hidden_layers"]):
                raise ConfigError(f"{source}: full_attention_interval must be a positive integer (with an "
                                  f"integer num_hidden_layers), got {interval!r}")
            kwargs["layer_types"] = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(kwargs["num_hidden_layers"]))
        try:
            return cls(eos_token_id=eos, **kwargs)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        except TypeError as err:
            raise ConfigError(f"{source}: {err}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_field(source: str, name: str, value: Any) -> float:
    """A config.json number as a float; anything else is a ConfigError naming the field."""
    if not _is_number(value):
        raise ConfigError(f"{source}: {name} must be a number, got {value!r}")
    return float(value)
