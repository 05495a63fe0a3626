"""Loader: HF layouts (plain, sharded, qwen3_5 wrapper), the tiny default, and clear errors for broken dirs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.loader import CheckpointError, load_model
from engine.model.runner import ModelRunner
from engine.model.tiny import ensure_tiny_checkpoint
from engine.cache.sequence import SequenceState


def last_logits(model, prompt):
    runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=1)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    return runner.prefill_chunk(seq, prompt, 0, len(prompt), True)


@pytest.fixture
def checkpoint_copy(hf_checkpoint, tmp_path):
    _, directory = hf_checkpoint("base")
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def test_sharded_checkpoint_loads_identically(hf_checkpoint, tmp_path):
    hf_model, directory = hf_checkpoint("base")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(last_logits(load_model(tmp_path)[0], prompt), last_logits(load_model(directory)[0], prompt))


def test_qwen3_5_wrapper_config_with_language_model_prefix(checkpoint_copy, hf_checkpoint):
    _, directory = hf_checkpoint("base")
    text_config = json.loads((checkpoint_copy / "config.json").read_text())
    wrapper = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": text_config, "tie_word_embeddings": False}
    (checkpoint_copy / "config.json").write_text(json.dumps(wrapper))
    tensors = load_file(str(checkpoint_copy / "model.safetensors"))
    renamed = {(name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name): t
               for name, t in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)  # vision weights are ignored
    save_file(renamed, str(checkpoint_copy / "model.safetensors"))
    prompt = [7, 7, 2]
    assert torch.equal(last_logits(load_model(checkpoint_copy)[0], prompt),
                       last_logits(load_model(directory)[0], prompt))


def test_missing_tensor_is_named(checkpoint_copy):
    tensors = load_file(str(checkpoint_copy / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, str(checkpoint_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.linear_attn\.A_log"):
        load_model(checkpoint_copy)


def test_shape_mismatch_names_file_and_tensor(checkpoint_copy):
    tensors = load_file(str(checkpoint_copy / "model.safetensors"))
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    save_file(tensors, str(checkpoint_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.3\.self_attn\.k_proj"
                                              r"\.weight has shape \(5, 64\)"):
        load_model(checkpoint_copy)


def test_missing_shard_is_named(hf_checkpoint, tmp_path):
    hf_model, _ = hf_checkpoint("base")
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing shard"):
        load_model(tmp_path)


def test_unknown_architecture(checkpoint_copy):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["model_type"] = "llama"
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown architecture model_type='llama'"):
        load_model(checkpoint_copy)


def test_bad_layer_type_and_empty_dir(checkpoint_copy, tmp_path):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["layer_types"][0] = "mamba"
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layer_types has unknown layer types"):
        load_model(checkpoint_copy)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_model(empty)
    (empty / "config.json").write_text((checkpoint_copy / "config.json").read_text().replace("mamba", "full_attention"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(empty)


def test_tiny_is_created_once_and_has_special_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSCOPE_CACHE", str(tmp_path))
    directory = ensure_tiny_checkpoint()
    assert directory == tmp_path / "tiny"
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint() == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp
    model, config, tokenizer = load_model("tiny")
    assert config.layer_types.count("linear_attention") == 3 * config.layer_types.count("full_attention")
    assert model.is_mla is False and model.is_ep is False and model.prefill_tail_split(100) is None
    specials = [model.eos_token_id, model.think_start_id, model.think_end_id, model.tool_call_start_id,
                model.tool_call_end_id, model.code_fence_id]
    assert None not in specials and len(set(specials)) == 6
    assert all(256 <= t < config.vocab_size for t in specials)
    assert tokenizer.decode(tokenizer.encode("héllo ```x")) == "héllo ```x"
    assert tokenizer.encode("<think>") == [model.think_start_id]
    # Same seed, same weights: a second build in another cache is bit-identical.
    monkeypatch.setenv("CHUNKSCOPE_CACHE", str(tmp_path / "other"))
    assert load_file(str(ensure_tiny_checkpoint() / "model.safetensors")).keys() == \
        load_file(str(directory / "model.safetensors")).keys()
    a = load_file(str(tmp_path / "other" / "tiny" / "model.safetensors"))
    b = load_file(str(directory / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
