"""Qwen3.5 with images: logits and 20 greedy tokens match transformers' *ForConditionalGeneration.

tiny-vl and two random configs written by save_pretrained (dense and MoE), prompts with 1-3
images of different sizes; the oracle runs the whole prompt in one shot (float32) with the
M-RoPE positions its own ``get_rope_index`` computes, which must equal ours. Chunk sizes that
split an image give the same greedy tokens as the whole prompt.
"""
from __future__ import annotations

import pytest
import torch

from engine.cache.sequence import SequenceState
from engine.model.batch import build_batch
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.multimodal.chunk_inputs import attach_images
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.limits import ImageSettings
from engine.multimodal.preprocess import prepare_image
from engine.multimodal.prompt_images import PromptImages, placeholder_tokens
from tests.engine.model.vision_checkpoints import VL_CONFIGS, build_vl_checkpoint, png_bytes

transformers = pytest.importorskip("transformers")
TOLERANCE = 1e-4
NAMES = ["tiny-vl", *VL_CONFIGS]
# (height, width) per image: 1, 2 and 3 images of different sizes and aspect ratios.
IMAGE_SETS = {"tiny-vl": [(40, 72)], "vl_dense": [(30, 20), (17, 45)], "vl_moe": [(24, 24), (9, 50), (40, 31)]}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def build(name: str):
        if name not in cache:
            hf, directory = build_vl_checkpoint(name, tmp_path_factory.mktemp)
            model, config, _ = load_model(directory)
            vision = model.vision_config
            factor = (vision.patch_size * vision.spatial_merge_size) ** 2
            settings = ImageSettings.for_checkpoint(vision, directory if name == "tiny-vl" else None)
            if name != "tiny-vl":
                settings = ImageSettings(vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size,
                                         min_pixels=4 * factor, max_pixels=48 * factor)
            cache[name] = (hf, model, config, settings)
        return cache[name]

    return build


def image_prompt(name, model, config, settings, seed=0):
    """Text, then each image's placeholder run between text pieces; (prompt, prepared images)."""
    vision = model.vision_config
    images = [prepare_image(png_bytes(h, w, seed + i), settings) for i, (h, w) in enumerate(IMAGE_SETS[name])]
    generator = torch.Generator().manual_seed(seed)
    text_ids = [t for t in range(config.vocab_size) if t not in (vision.image_token_id, vision.vision_start_token_id,
                                                                 vision.vision_end_token_id, config.eos_token_id)]

    def text(n):
        return [text_ids[i] for i in torch.randint(0, len(text_ids), (n,), generator=generator).tolist()]

    prompt = text(5)
    for image in images:
        prompt += placeholder_tokens(image, vision.vision_start_token_id, vision.image_token_id,
                                     vision.vision_end_token_id) + text(4)
    return prompt, images


def oracle_inputs(model, prompt, images):
    vision = model.vision_config
    ids = torch.tensor([prompt])
    return dict(input_ids=ids, pixel_values=torch.cat([im.patches for im in images]),
                image_grid_thw=torch.tensor([im.grid for im in images]),
                mm_token_type_ids=(ids == vision.image_token_id).int())


@pytest.mark.parametrize("name", NAMES)
def test_every_position_logits_and_positions_match_transformers(vl, name):
    hf, model, config, settings = vl(name)
    prompt, images = image_prompt(name, model, config, settings)
    inputs = oracle_inputs(model, prompt, images)
    positions, deltas = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                inputs["image_grid_thw"])
    ours = PromptImages.build(prompt, images, model.vision_config.image_token_id)
    assert torch.equal(ours.positions, positions[:, 0]) and ours.delta == int(deltas[0, 0])
    with torch.no_grad():
        expected = hf(**inputs, position_ids=positions).logits[0]  # [L, V]
    runner = ModelRunner.build(model, num_kv_blocks=-(-len(prompt) // 16) + 1, num_ssm_slots=2)
    seq = SequenceState(0, images=ours)
    runner.pools.admit(seq)
    runner.pools.blocks.allocate(seq, len(prompt))
    batch = build_batch((prompt, 0, seq.block_table, seq.ssm_slot), [], runner.kv_block_size)
    covered = attach_images(batch, seq, 0, len(prompt), [], model.visual, EncoderCache())
    assert len(covered) == len(images)
    actual = model(batch, runner.pools.kv_store, runner.pools.ssm)  # [L, V]
    assert (actual - expected).abs().max().item() <= TOLERANCE


def greedy_tokens(model, prompt, images, chunk: int, steps: int = 20) -> list[int]:
    runner = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=2)
    seq = SequenceState(0, images=PromptImages.build(prompt, images, model.vision_config.image_token_id))
    runner.pools.admit(seq)
    offset = 0
    while offset < len(prompt):
        length = min(chunk, len(prompt) - offset)
        logits = runner.prefill_chunk(seq, prompt, offset, length, offset + length == len(prompt))
        offset += length
    tokens = [int(logits.argmax())]
    while len(tokens) < steps:
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    return tokens


@pytest.mark.parametrize("name", NAMES)
def test_twenty_greedy_tokens_match_transformers_and_split_chunks_agree(vl, name):
    hf, model, config, settings = vl(name)
    prompt, images = image_prompt(name, model, config, settings, seed=3)
    inputs = oracle_inputs(model, prompt, images)
    with torch.no_grad():
        out = hf.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False, pad_token_id=config.vocab_size - 1)
    expected = out[0, len(prompt):].tolist()
    whole = greedy_tokens(model, prompt, images, chunk=len(prompt))
    assert whole == expected
    first_image = PromptImages.build(prompt, images, model.vision_config.image_token_id).spans[0]
    # Chunks of 7 and one cut in the middle of the first image both split image placeholder runs.
    for chunk in (7, first_image.start + first_image.image.num_tokens // 2):
        assert greedy_tokens(model, prompt, images, chunk) == whole
