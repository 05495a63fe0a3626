"""A checkpoint in the real Qwen3.5 layout with an MTP module loads and drafts; broken MTP tensors name themselves.

The layout: config.json ``model_type: qwen3_5`` with the text config under ``text_config``
(``mtp_num_hidden_layers: 1``), the decoder under ``model.language_model.*``, the MTP module at
the top level (``mtp.fc.weight`` [H, 2H], ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, ``mtp.layers.0.*``, ``mtp.norm.weight``).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.loader import CheckpointError, load_model
from engine.model.mtp import attach_mtp
from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.runner import ModelRunner
from engine.model.tiny import random_init
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                     eos_token_id=None, mtp_num_hidden_layers=1)
MTP_NAMES = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
             "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
             "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
             "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
             "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.mlp.up_proj.weight",
             "mtp.layers.0.mlp.down_proj.weight", "mtp.layers.0.input_layernorm.weight",
             "mtp.layers.0.post_attention_layernorm.weight"}


def real_layout_tensors(seed: int = 3) -> dict[str, torch.Tensor]:
    model = Qwen35ForCausalLM(CONFIG)
    attach_mtp(model)
    random_init(model, seed)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        tensors[name] = tensor.contiguous()
    return tensors


def write(directory, tensors, text_overrides=None):
    directory.mkdir(parents=True, exist_ok=True)
    text = {**CONFIG.to_hf_dict(), **(text_overrides or {})}
    for key in ("architectures", "dtype"):
        text.pop(key)
    text["model_type"] = "qwen3_5_text"
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def tensors():
    return real_layout_tensors()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tensors):
    return write(tmp_path_factory.mktemp("qwen35-mtp"), tensors)


def test_layout_has_the_real_mtp_names_and_shapes(tensors):
    assert {n for n in tensors if n.startswith("mtp.")} == MTP_NAMES
    assert tuple(tensors["mtp.fc.weight"].shape) == (64, 128)  # [H, 2H]
    assert not any(n.startswith("mtp.") and "embed" in n and "norm" not in n for n in tensors)  # shared


def test_loads_every_mtp_tensor_and_drafts(checkpoint, tensors):
    model, config, _ = load_model(checkpoint)
    assert config.mtp_num_hidden_layers == 1 and model.has_mtp_head
    for name in MTP_NAMES:
        torch.testing.assert_close(model.state_dict()[name], tensors[name], rtol=0, atol=0)
    runner = ModelRunner.build(model, num_kv_blocks=32, num_ssm_slots=2)
    assert 4 in runner.pools.kv_store.keys  # the MTP layer's own paged K/V, beside layer 3's
    prompt = [5, 9, 17, 33, 65, 2, 7, 11] * 3
    outputs = {}
    for kind in ("off", "mtp"):
        rows: list = []
        sched = Scheduler(ModelRunner.build(model, num_kv_blocks=32, num_ssm_slots=2),
                          defaults().replace(speculation=kind), emit=rows.append)
        assert sched.levers.speculation == kind
        request = sched.submit(0, prompt, {"max_tokens": 20})
        while sched.has_work:
            sched.step()
        outputs[kind] = request.output_tokens
        if kind == "mtp":
            steps = [r.detail for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"]
            assert sum(d["num_drafted"] for d in steps) > 0, "the loaded MTP module never drafted"
    assert outputs["mtp"] == outputs["off"]


@pytest.mark.parametrize("missing", ["mtp.layers.0.mlp.down_proj.weight", "mtp.fc.weight", "mtp.norm.weight"])
def test_a_missing_mtp_tensor_names_itself(tmp_path, tensors, missing):
    directory = write(tmp_path / "ckpt", {n: t for n, t in tensors.items() if n != missing})
    with pytest.raises(CheckpointError, match=f"missing tensor {missing}"):
        load_model(directory)


def test_a_misshaped_mtp_tensor_names_itself(tmp_path, tensors):
    broken = dict(tensors, **{"mtp.fc.weight": torch.zeros(64, 64)})
    with pytest.raises(CheckpointError, match=r"tensor mtp.fc.weight has shape \(64, 64\).*\(64, 128\)"):
        load_model(write(tmp_path / "ckpt", broken))


def test_without_mtp_tensors_the_model_has_no_head_and_says_why(tmp_path, tensors):
    directory = write(tmp_path / "ckpt", {n: t for n, t in tensors.items() if not n.startswith("mtp.")})
    model, config, _ = load_model(directory)
    assert config.mtp_num_hidden_layers == 1 and not model.has_mtp_head
    assert "holds no mtp.* tensors" in model.mtp_absent_reason
    rows: list = []
    sched = Scheduler(ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=1),
                      defaults().replace(speculation="mtp"), emit=rows.append)
    assert sched.levers.speculation == "off"
    reasons = [r.reason for r in rows if isinstance(r, ev.LeverChange) and r.status == "rejected"]
    assert reasons and "holds no mtp.* tensors" in reasons[0]


def test_dedicated_mtp_embeddings_are_refused_clearly(tmp_path, checkpoint):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["text_config"]["mtp_use_dedicated_embeddings"] = True
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mtp_use_dedicated_embeddings=true is not supported"):
        load_model(directory)
