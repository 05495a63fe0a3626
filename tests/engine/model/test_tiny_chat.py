"""The shipped ``tiny-chat``: its files match the manifest, it loads as an embedded model (MTP head and
seeded vision tower), a text-only prompt runs exactly as without the tower, and its training script
reproduces the recorded losses from the seed (the first steps: CI stays short)."""
from __future__ import annotations

import json
import shutil

import pytest

import torch

from engine.api.chat_template import ChatTemplate
from engine.cache.sequence import SequenceState
from engine.cli.generate import generate, generate_speculative
from engine.model.embedded import EMBEDDED_MODELS, checkpoint_dir_of
from engine.model.errors import CheckpointError
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.model.tiny_chat import HASHED_FILES, SHIPPED_DIRS, TINY_CHAT_DIR, read_manifest, verify_manifest
from engine.multimodal.request_images import RequestImages
from engine.multimodal.seeded_image import seeded_png
from engine.scheduler.loop import Scheduler
from engine.scheduler.request_features import RequestFeatures
from engine.scheduler.sampling import SamplingParams
from engine.serve.driver import TickDriver
from telemetry.events import GenericEvent
from telemetry.levers import defaults
from engine.train.loop import TrainSettings, train

MAX_BYTES = 20 * 2**20


@pytest.mark.parametrize("name, family, extra", [("tiny-chat", "dense", {"preprocessor_config.json"}),
                                                ("tiny-chat-moe", "moe", set())])
def test_the_shipped_files_match_their_manifest_and_stay_small(name, family, extra):
    directory = SHIPPED_DIRS[name]
    verify_manifest(directory)
    manifest = read_manifest(directory)
    assert set(manifest["sha256"]) == set(HASHED_FILES) | extra
    assert sum(p.stat().st_size for p in directory.iterdir()) <= MAX_BYTES
    # The script's defaults are what made the shipped weights: `python -m engine.train [--family moe]`
    # reproduces them.
    assert manifest["settings"] == TrainSettings(family=family).to_dict()
    assert 0 < manifest["final_loss"] < manifest["early_losses"][0] / 4
    assert name in EMBEDDED_MODELS and checkpoint_dir_of(name) == directory


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


@pytest.fixture(scope="module")
def with_and_without_tower(tmp_path_factory):
    """tiny-chat as shipped, and the same files with config.json cut to its text part (no tower loaded)."""
    text_only = tmp_path_factory.mktemp("tiny-chat-text") / "ckpt"
    shutil.copytree(TINY_CHAT_DIR, text_only)
    config = json.loads((text_only / "config.json").read_text())
    (text_only / "config.json").write_text(json.dumps(config["text_config"]))
    return load_model("tiny-chat"), load_model(text_only)


def test_tiny_chat_loads_with_its_mtp_head_template_chat_and_image_tokens(with_and_without_tower):
    (model, config, tokenizer), _ = with_and_without_tower
    assert model.has_mtp_head and config.mtp_num_hidden_layers == 1
    # The seeded tower (untrained) and the image tokens the API and the chat workload place.
    assert model.visual is not None and model.vision_config.out_hidden_size == config.hidden_size
    policy = RequestImages.for_model(model, TINY_CHAT_DIR).policy(tokenizer)
    assert tokenizer.encode(policy.placeholder_text(2)) == [266, 268, 268, 267]
    assert tokenizer.token_id("</think>") == model.think_end_id and tokenizer.token_id("<|im_end|>") is not None
    template = ChatTemplate.for_checkpoint(TINY_CHAT_DIR)
    assert template.origin.startswith("checkpoint")
    prompt = template.render([{"role": "user", "content": "hi"}], None, enable_thinking=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_a_text_only_prompt_runs_exactly_as_without_the_tower(with_and_without_tower):
    """Same logits, same greedy tokens, same MTP drafts accepted: the tower changes nothing for text."""
    (tower, _, tokenizer), (text, _, _) = with_and_without_tower
    assert text.visual is None and text.has_mtp_head
    template = ChatTemplate.for_checkpoint(TINY_CHAT_DIR)
    prompt = tokenizer.encode(template.render([{"role": "user", "content": "List 3 colors."}], None,
                                              enable_thinking=True))
    logits = []
    for model in (tower, text):
        runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=1)
        seq = SequenceState(0)
        runner.pools.admit(seq)
        logits.append(runner.prefill_chunk(seq, prompt, 0, len(prompt), True))
    assert torch.equal(*logits)
    params = SamplingParams(max_tokens=24)
    plain = [generate(m, tokenizer, prompt, params)["tokens"] for m in (tower, text)]
    assert plain[0] == plain[1]
    drafted = [generate_speculative(m, tokenizer, prompt, params, "mtp", 2) for m in (tower, text)]
    assert drafted[0]["tokens"] == drafted[1]["tokens"] == plain[0]
    assert drafted[0]["spec"] == drafted[1]["spec"] and drafted[0]["spec"]["accepted"] > 0


def test_mtp_drafts_past_an_image_and_keeps_the_greedy_tokens(with_and_without_tower):
    """The MTP head runs on a vision checkpoint: after an image it drafts on plain positions, and the
    main model's verify keeps the tokens of speculation off."""
    (model, _, tokenizer), _ = with_and_without_tower
    template = ChatTemplate.for_checkpoint(TINY_CHAT_DIR)
    outputs, steps = [], []
    for speculation in ("off", "mtp"):
        runner = ModelRunner.build(model, num_kv_blocks=32, num_ssm_slots=2)
        images = RequestImages.for_model(model, TINY_CHAT_DIR)
        rows: list = []
        sched = Scheduler(runner, defaults().replace(speculation=speculation), emit=rows.append, images=images)
        data = seeded_png(48, 100, 7)
        text = template.render([{"role": "user", "content": "List 3 colors."}], None, enable_thinking=False)
        prompt = tokenizer.encode(text.replace("user\n", "user\n" + images.policy(tokenizer).placeholder_text(
            len(images.placeholders(data)) - 2), 1))
        request = sched.submit(0, prompt, {"max_tokens": 24, "min_tokens": 24},
                               features=RequestFeatures(images=(images.store.put(data),)))
        assert request.error is None and request.num_images == 1
        TickDriver(sched).run()
        outputs.append(list(request.output_tokens))
        steps += [r.detail for r in rows if isinstance(r, GenericEvent) and r.kind == "spec_step"]
    assert outputs[0] == outputs[1]
    assert steps and all(s["kind"] == "mtp" for s in steps) and sum(s["num_accepted"] for s in steps) > 0


@pytest.mark.parametrize("name", ["tiny-chat", "tiny-chat-moe"])
def test_training_from_the_seed_reproduces_the_recorded_early_losses(name):
    manifest = read_manifest(SHIPPED_DIRS[name])
    recorded = manifest["early_losses"]
    _, losses = train(TrainSettings(**manifest["settings"]), steps=len(recorded), progress=False)
    for step, (got, want) in enumerate(zip((s.main for s in losses), recorded)):
        assert abs(got - want) <= 0.02 * want, f"step {step}: loss {got:.5f}, the manifest records {want:.5f}"


def test_tiny_chat_moe_is_a_routed_model_with_an_mtp_head_whose_drafts_keep_greedy_tokens():
    model, config, tokenizer = load_model("tiny-chat-moe")
    assert type(model).__name__ == "Qwen35MoeForCausalLM" and config.num_experts == 8 and model.has_mtp_head
    assert getattr(model, "visual", None) is None   # text only
    template = ChatTemplate.for_checkpoint(SHIPPED_DIRS["tiny-chat-moe"])
    prompt = tokenizer.encode(template.render([{"role": "user", "content": "List 3 fruits."}], None,
                                              enable_thinking=False))
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = generate(model, tokenizer, prompt, params)
    drafted = generate_speculative(model, tokenizer, prompt, params, "mtp", 2)
    assert drafted["tokens"] == plain["tokens"] and drafted["spec"]["accepted"] > 0
    # Trained (random weights write noise): the reply has the chat workload's list form. It does not
    # copy the count reliably (docs/benchmarks.md: the tiny models copy the question's facts poorly).
    reply = tokenizer.decode(plain["tokens"])
    assert reply.startswith("Here are ") and "fruits:\n1. " in reply
