"""config.json -> ModelConfig: what HF configs spell, what is derived, and bad fields named in one error.

Everything goes through ``read_config`` (the loader's entry) unless the test is about the dataclass
itself, so the errors are the ones a user of ``--model DIR`` sees: a ``CheckpointError`` naming the file.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from engine.model.config import ConfigError, ModelConfig
from engine.model.errors import CheckpointError
from engine.model.loader import read_config
from engine.model.tiny import TINY_CONFIG
from engine.model.tiny_moe import TINY_MOE_CONFIG


def write_config(directory, raw) -> None:
    (directory / "config.json").write_text(json.dumps(raw))


def changed(base: dict, **fields) -> dict:
    """``base`` with ``fields`` set; a value of ``...`` removes the field."""
    out = dict(base)
    for name, value in fields.items():
        if value is ...:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def refused(tmp_path, raw, match: str) -> str:
    write_config(tmp_path, raw)
    with pytest.raises(CheckpointError, match=match) as info:
        read_config(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "config.json") in message, "the error names the file"
    assert "\n" not in message
    return message


DENSE = TINY_CONFIG.to_hf_dict()


def test_the_tiny_configs_round_trip_through_config_json(tmp_path):
    for config in (TINY_CONFIG, TINY_MOE_CONFIG):
        write_config(tmp_path, config.to_hf_dict())
        assert read_config(tmp_path) == config


@settings(max_examples=40, deadline=None)
@given(kv_heads=st.integers(1, 4), group=st.integers(1, 3), head_dim=st.sampled_from([8, 16, 32]),
       linear_keys=st.integers(1, 3), linear_group=st.integers(1, 2), layers=st.integers(1, 9),
       interval=st.integers(1, 4), rotary=st.sampled_from([0.25, 0.5, 1.0]), moe=st.booleans(),
       tie=st.booleans(), eos=st.one_of(st.none(), st.integers(0, 99)))
def test_any_valid_config_survives_to_hf_dict_and_back(kv_heads, group, head_dim, linear_keys, linear_group,
                                                       layers, interval, rotary, moe, tie, eos):
    moe_fields = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=24) if moe else {}
    config = ModelConfig(
        vocab_size=100, hidden_size=48, intermediate_size=64 if not moe else 24, num_hidden_layers=layers,
        num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=linear_keys, linear_num_value_heads=linear_keys * linear_group,
        linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                          for i in range(layers)),
        partial_rotary_factor=rotary, tie_word_embeddings=tie, eos_token_id=eos, **moe_fields)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config
    full = config.full_attention_layers
    assert full == [i for i in range(layers) if (i + 1) % interval == 0]
    assert sorted(full + config.linear_attention_layers) == list(range(layers))


def test_a_qwen3_5_wrapper_reads_its_text_config_and_the_outer_tie_and_eos(tmp_path):
    text = changed(DENSE, tie_word_embeddings=..., eos_token_id=..., model_type="qwen3_5_text")
    write_config(tmp_path, {"model_type": "qwen3_5", "tie_word_embeddings": True, "eos_token_id": [7, 8],
                            "text_config": text})
    config = read_config(tmp_path)
    assert config.tie_word_embeddings is True
    assert config.eos_token_id == 7, "a list of EOS ids: the first is the model's"
    assert config.hidden_size == TINY_CONFIG.hidden_size


def test_an_empty_eos_list_means_no_eos(tmp_path):
    write_config(tmp_path, changed(DENSE, eos_token_id=[]))
    assert read_config(tmp_path).eos_token_id is None


def test_derived_fields_when_config_json_leaves_them_out(tmp_path):
    raw = changed(DENSE, head_dim=..., layer_types=..., linear_num_key_heads=..., linear_num_value_heads=...,
                  linear_key_head_dim=..., linear_value_head_dim=..., rope_parameters=...,
                  num_hidden_layers=6, full_attention_interval=3, partial_rotary_factor=0.5)
    write_config(tmp_path, raw)
    config = read_config(tmp_path)
    assert config.head_dim == DENSE["hidden_size"] // DENSE["num_attention_heads"]
    assert config.full_attention_layers == [2, 5] and config.linear_attention_layers == [0, 1, 3, 4]
    # Qwen3.5's defaults for the linear-attention heads, and the rotary factor from the top level.
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (128, 128)
    assert config.partial_rotary_factor == 0.5 and config.rope_theta == 10000.0


def test_a_dense_config_ignores_moe_fields_and_a_moe_config_needs_all_of_them(tmp_path):
    write_config(tmp_path, changed(DENSE, num_experts=8, num_experts_per_tok=2))
    assert not read_config(tmp_path).is_moe
    moe = TINY_MOE_CONFIG.to_hf_dict()
    refused(tmp_path, changed(moe, moe_intermediate_size=...), r"missing field\(s\) moe_intermediate_size")
    refused(tmp_path, changed(moe, num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds num_experts")


@pytest.mark.parametrize("raw, match", [
    ([1, 2], "must hold a JSON object, got list"),
    ({"model_type": "qwen3_5", "text_config": "x"}, "needs a text_config object"),
    (changed(DENSE, rope_parameters="default"), "rope_parameters must be an object"),
    (changed(DENSE, rope_parameters={"rope_type": "yarn"}), "rope_type 'yarn' is not supported"),
    (changed(DENSE, rope_parameters={"rope_theta": "big"}), "rope_parameters.rope_theta must be a number"),
    (changed(DENSE, rope_parameters={"partial_rotary_factor": None}), "partial_rotary_factor must be a number"),
    (changed(DENSE, rope_parameters={"partial_rotary_factor": 2.0}), "rotary dim 64, which must be even"),
    (changed(DENSE, layer_types=..., full_attention_interval=0), "full_attention_interval must be a positive"),
    (changed(DENSE, layer_types=..., full_attention_interval="4"), "full_attention_interval must be a positive"),
    (changed(DENSE, layer_types=5), "layer_types must be a list"),
    (changed(DENSE, layer_types=["linear_attention"] * 3), "layer_types has 3 entries, num_hidden_layers is 4"),
    (changed(DENSE, head_dim=..., num_attention_heads=0), "head_dim is absent and cannot be derived"),
    (changed(DENSE, num_attention_heads="8"), "num_attention_heads must be a positive integer, got '8'"),
    (changed(DENSE, vocab_size=True), "vocab_size must be a positive integer, got True"),
    (changed(DENSE, num_key_value_heads=3), "multiple of num_key_value_heads"),
    (changed(DENSE, linear_num_key_heads=3), "multiple of linear_num_key_heads"),
    (changed(DENSE, rms_norm_eps=-1e-6), "rms_norm_eps must be a positive number"),
    (changed(DENSE, max_position_embeddings=0), "max_position_embeddings must be a positive integer"),
    (changed(DENSE, tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (changed(DENSE, eos_token_id="</s>"), "eos_token_id must be a token id"),
    (changed(DENSE, hidden_act="gelu"), "hidden_act must be 'silu'"),
    (changed(DENSE, mtp_num_hidden_layers=-1), "mtp_num_hidden_layers must be an integer >= 0"),
    (changed(DENSE, mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings=true is not supported"),
    (changed(DENSE, num_hidden_layers=...), r"missing field\(s\) num_hidden_layers"),
])
def test_a_bad_field_is_one_error_naming_it(tmp_path, raw, match):
    refused(tmp_path, raw, match)


def test_the_dataclass_checks_what_code_builds_too():
    fields = {**TINY_CONFIG.__dict__, "layer_types": ()}
    with pytest.raises(ConfigError, match="rope_theta must be a positive number"):
        ModelConfig(**{**fields, "rope_theta": float("inf")})
    with pytest.raises(ConfigError, match="attention_bias must be true or false"):
        ModelConfig(**{**fields, "attention_bias": 1})
    default = ModelConfig(**fields)
    assert default.full_attention_layers == [3], "no layer_types: every 4th layer is full attention"
    assert default.conv_dim == 2 * default.linear_key_dim + default.linear_value_dim
