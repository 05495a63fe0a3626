"""Our image preprocessing equals transformers' Qwen2VLImageProcessorPil; bad images are clear errors."""
from __future__ import annotations

import pytest
import torch

from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.limits import ImageError, ImageLimits, ImageSettings, fit_size
from engine.multimodal.preprocess import prepare_image
from tests.engine.model.vision_checkpoints import png_bytes

transformers = pytest.importorskip("transformers")
SETTINGS = ImageSettings(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=4096,
                         mean=(0.48, 0.45, 0.40), std=(0.27, 0.26, 0.28))


@pytest.mark.parametrize("size", [(30, 20), (17, 45), (120, 90), (8, 8)])  # down, up and near-identity resizes
def test_patches_and_grid_match_the_transformers_processor(size):
    from PIL import Image
    import io

    data = png_bytes(*size, seed=sum(size))
    ours = prepare_image(data, SETTINGS)
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=list(SETTINGS.mean),
        image_std=list(SETTINGS.std), size={"shortest_edge": 256, "longest_edge": 4096})
    expected = processor(Image.open(io.BytesIO(data)), return_tensors="pt")
    assert ours.grid == tuple(expected["image_grid_thw"][0].tolist())
    assert (ours.patches - expected["pixel_values"].float()).abs().max().item() < 1e-5


def test_fit_size_equals_transformers_smart_resize():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for h, w in [(1000, 10), (7, 9), (333, 777), (64, 64), (15, 200)]:
        assert fit_size(h, w, 8, 256, 4096) == smart_resize(h, w, 8, 256, 4096)


def test_bad_images_are_clear_errors():
    with pytest.raises(ImageError, match="not a decodable image"):
        prepare_image(b"definitely not a png", SETTINGS)
    with pytest.raises(ImageError, match="over the limit of 100"):
        prepare_image(png_bytes(20, 20, 0), SETTINGS, ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="pixels, over the limit"):
        prepare_image(png_bytes(40, 40, 0), SETTINGS, ImageLimits(max_pixels=1000))
    with pytest.raises(ImageError, match="aspect ratio"):
        prepare_image(png_bytes(1, 300, 0), SETTINGS)


def test_the_encoder_cache_counts_and_evicts_only_unreferenced_entries():
    cache = EncoderCache(capacity_rows=10)
    runs = []

    def encode(n):
        return lambda: runs.append(n) or torch.zeros(n, 2)

    cache.acquire("a")
    cache.get("a", encode(6))
    cache.get("a", encode(6))
    cache.get("b", encode(6))          # over capacity: "a" is referenced, so the new "b" goes
    assert "a" in cache and "b" not in cache
    cache.release("a")
    cache.get("c", encode(6))          # "a" unreferenced now: evicted for "c"
    assert "a" not in cache and "c" in cache
    assert (cache.hits, cache.misses, cache.evictions) == (1, 3, 2) and runs == [6, 6, 6]
    assert [e.kind for e in cache.take_events()] == ["run", "hit", "run", "run"] and cache.take_events() == []
