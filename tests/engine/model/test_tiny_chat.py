"""The shipped ``tiny-chat``: its files match the manifest, it loads as an embedded model, and its
training script reproduces the recorded losses from the seed (the first steps: CI stays short)."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.api.chat_template import ChatTemplate
from engine.model.embedded import EMBEDDED_MODELS, checkpoint_dir_of
from engine.model.errors import CheckpointError
from engine.model.loader import load_model
from engine.model.tiny_chat import HASHED_FILES, TINY_CHAT_DIR, read_manifest, verify_manifest
from engine.train.loop import TrainSettings, train

MAX_BYTES = 20 * 2**20


def test_the_shipped_files_match_their_manifest_and_stay_small():
    verify_manifest()
    manifest = read_manifest()
    assert set(manifest["sha256"]) == set(HASHED_FILES)
    assert sum(p.stat().st_size for p in TINY_CHAT_DIR.iterdir()) <= MAX_BYTES
    # The script's defaults are what made the shipped weights: `python -m engine.train` reproduces them.
    assert manifest["settings"] == TrainSettings().to_dict()
    assert 0 < manifest["final_loss"] < manifest["early_losses"][0] / 4
    assert "tiny-chat" in EMBEDDED_MODELS and checkpoint_dir_of("tiny-chat") == TINY_CHAT_DIR


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_a_file_that_differs_from_the_manifest_is_refused_by_name(tmp_path, damage):
    copy = tmp_path / "tiny_chat"
    shutil.copytree(TINY_CHAT_DIR, copy)
    config = copy / "config.json"
    if damage == "changed":
        config.write_text(json.dumps({**json.loads(config.read_text()), "rms_norm_eps": 1e-5}))
    else:
        config.unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        verify_manifest(copy)


def test_tiny_chat_loads_with_its_mtp_head_template_and_chat_tokens():
    model, config, tokenizer = load_model("tiny-chat")
    assert model.has_mtp_head and config.mtp_num_hidden_layers == 1
    assert tokenizer.token_id("</think>") == model.think_end_id and tokenizer.token_id("<|im_end|>") is not None
    template = ChatTemplate.for_checkpoint(TINY_CHAT_DIR)
    assert template.origin.startswith("checkpoint")
    prompt = template.render([{"role": "user", "content": "hi"}], None, enable_thinking=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_training_from_the_seed_reproduces_the_recorded_early_losses():
    manifest = read_manifest()
    recorded = manifest["early_losses"]
    _, losses = train(TrainSettings(**manifest["settings"]), steps=len(recorded), progress=False)
    for step, (got, want) in enumerate(zip((s.main for s in losses), recorded)):
        assert abs(got - want) <= 0.02 * want, f"step {step}: loss {got:.5f}, the manifest records {want:.5f}"
