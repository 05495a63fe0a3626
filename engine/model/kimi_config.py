"""The Kimi Linear configuration (``model_type: kimi_linear``), read from an HF ``config.json`` and checked.

Two spellings reach us: Moonshot's own config.json (``linear_attn_config`` with 1-indexed
``full_attn_layers`` / ``kda_layers``, ``first_k_dense_replace``, ``num_experts_per_token``, ...) and
the one transformers' ``save_pretrained`` writes (``layer_types`` and ``mlp_layer_types`` as lists,
plus the same sub-dict). Both land in one frozen dataclass; the properties at the end give the
names the rest of the engine reads from any model config (the SSM pool's shapes, the K/V layers).
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

from engine.model.config import LAYER_TYPES, ConfigError, HybridLayers

MODEL_TYPE = "kimi_linear"
MLP_TYPES = ("dense", "sparse")
# (our field, the other names a config.json may use for it), first match wins.
ALIASES = {
    "num_experts": ("num_local_experts",),
    "num_experts_per_tok": ("num_experts_per_token",),
    "num_shared_experts": ("n_shared_experts",),
    "norm_topk_prob": ("moe_renormalize",),
    "n_group": ("num_expert_group",),
    "max_position_embeddings": ("model_max_length",),
}


@dataclass(frozen=True)
class KimiConfig(HybridLayers):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # MLA: a kv_lora_rank latent plus a qk_rope_head_dim key part shared by all heads, per token.
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA: q, k and v all have linear_num_heads heads of linear_head_dim.
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    q_lora_rank: int | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    mlp_layer_types: tuple[str, ...] = field(default_factory=tuple)
    # Sparse MLP layers: sigmoid router with a score-correction bias, grouped top-k, a scaled sum.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    eos_token_id: int | None = None
    max_position_embeddings: int = 32768
    mtp_num_hidden_layers: int = 0  # Kimi Linear has no MTP module

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_num_heads",
                     "linear_head_dim", "linear_conv_kernel_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ConfigError(f"config field q_lora_rank must be null or a positive integer, got {self.q_lora_rank!r}")
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(types) != self.num_hidden_layers:
                raise ConfigError(f"config field {name} has {len(types)} entries, num_hidden_layers is "
                                  f"{self.num_hidden_layers}")
            unknown = sorted(set(types) - set(allowed))
            if unknown:
                raise ConfigError(f"config field {name} has unknown entries {unknown}; allowed: {', '.join(allowed)}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field hidden_act must be 'silu', got {self.hidden_act!r}")
        if "sparse" in self.mlp_layer_types:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
                         "n_group", "topk_group"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"config field num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                  f"num_experts ({self.num_experts})")
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ConfigError(f"config fields n_group={self.n_group} / topk_group={self.topk_group} do not "
                                  f"split {self.num_experts} experts into groups")
            if self.num_experts // self.n_group < 2:
                raise ConfigError("config field n_group leaves fewer than 2 experts per group (a group's score "
                                  "is its top-2 sum)")

    # ---- the names every model config answers (runner, SSM pool, K/V layers, admission) ----------
    @property
    def is_moe(self) -> bool:
        return "sparse" in self.mlp_layer_types

    @property
    def linear_num_key_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_num_value_heads(self) -> int:
        return self.linear_num_heads

    @property
    def linear_key_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def linear_value_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_key_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the short convolution: q, k and v."""
        return 3 * self.linear_key_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cached row per token and MLA layer: the normed kv latent, then the shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_kv_width(self) -> int:
        """What the same layer would cache per token without the latent: every head's K and V."""
        return self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers' KimiLinearConfig reads (and Moonshot's field names)."""
        data = asdict(self)
        data.pop("mtp_num_hidden_layers")
        data["layer_types"], data["mlp_layer_types"] = list(self.layer_types), list(self.mlp_layer_types)
        data["linear_attn_config"] = {
            "head_dim": self.linear_head_dim, "num_heads": self.linear_num_heads,
            "short_conv_kernel_size": self.linear_conv_kernel_dim,
            "full_attn_layers": [i + 1 for i in self.full_attention_layers],
            "kda_layers": [i + 1 for i in self.linear_attention_layers]}
        data.update(model_type=MODEL_TYPE, architectures=["KimiLinearForCausalLM"], dtype="float32",
                    num_key_value_heads=self.num_attention_heads, pad_token_id=None, bos_token_id=None)
        return data

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "KimiConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"{source}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        text = dict(raw)
        for ours, others in ALIASES.items():
            for other in others:
                if ours not in text and other in text:
                    text[ours] = text[other]
        linear = text.get("linear_attn_config") or {}
        if not isinstance(linear, dict):
            raise ConfigError(f"{source}: linear_attn_config must be an object")
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size")):
            if theirs in linear:
                text[ours] = linear[theirs]
        _refuse_unsupported(text, source)
        layers = text.get("num_hidden_layers")
        if not isinstance(layers, int) or layers <= 0:
            raise ConfigError(f"{source}: num_hidden_layers must be a positive integer, got {layers!r}")
        text["layer_types"] = text.get("layer_types") or _layer_types_from(linear, layers, source)
        if not text.get("mlp_layer_types"):
            dense = int(text.get("first_k_dense_replace", 1))
            text["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(layers)]
        heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            # kv_b_proj makes one key / value head per query head: there is nothing to group.
            raise ConfigError(f"{source}: num_key_value_heads ({kv_heads}) must equal num_attention_heads "
                              f"({heads}) for latent attention")
        eos = text.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        kwargs = {name: text[name] for name in cls.__dataclass_fields__ if name in text}
        kwargs["eos_token_id"] = eos
        missing = [name for name, spec in cls.__dataclass_fields__.items()
                   if name not in kwargs and spec.default is MISSING and spec.default_factory is MISSING]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        try:
            return cls(**kwargs)
        except (ConfigError, TypeError) as err:
            raise ConfigError(f"{source}: {err}") from None


def _layer_types_from(linear: dict, layers: int, source: str) -> list[str]:
    """Moonshot's 1-indexed ``full_attn_layers`` / ``kda_layers``, else transformers' default pattern."""
    if "full_attn_layers" in linear and "kda_layers" in linear:
        types: list[str | None] = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for index in linear[key]:
                if not isinstance(index, int) or not 1 <= index <= layers:
                    raise ConfigError(f"{source}: linear_attn_config.{key} names layer {index!r}, outside "
                                      f"1..{layers}")
                types[index - 1] = kind
        if None in types:
            raise ConfigError(f"{source}: linear_attn_config leaves layer {types.index(None) + 1} without a type")
        return types  # type: ignore[return-value]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def _refuse_unsupported(text: dict, source: str) -> None:
    """Variants of the family this engine does not run, named instead of run wrong."""
    if text.get("mla_use_nope") is False:
        raise ConfigError(f"{source}: mla_use_nope=false (rotary on the MLA key part) is not supported")
    activation = text.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ConfigError(f"{source}: moe_router_activation_func {activation!r} is not supported (sigmoid only)")
    if int(text.get("moe_layer_freq", 1)) != 1:
        raise ConfigError(f"{source}: moe_layer_freq {text['moe_layer_freq']!r} is not supported (1 only)")
