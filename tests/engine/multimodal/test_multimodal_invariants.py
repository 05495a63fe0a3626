"""Invariants of the image pieces, over many inputs: the resize rule, the image store, the encoder
cache's references and bound, and how chunks cover a prompt's images."""
from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.image_store import ImageStore
from engine.multimodal.limits import ImageError, ImageSettings, fit_size
from engine.multimodal.preprocess import prepare_image
from engine.multimodal.prompt_images import PromptImages, placeholder_tokens
from tests.engine.model.vision_checkpoints import png_bytes

SETTINGS = ImageSettings(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=2048)
START, PAD, END = 300, 301, 302


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 3000), width=st.integers(1, 3000), factor=st.sampled_from([8, 14, 28, 32]),
       max_tiles=st.integers(4, 1024))
def test_fit_size_equals_transformers_smart_resize_everywhere(height, width, factor, max_tiles):
    smart_resize = pytest.importorskip(
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl").smart_resize
    min_pixels, max_pixels = factor * factor * 4, factor * factor * max_tiles
    try:
        expected = smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError:            # transformers refuses an aspect ratio over 200
        with pytest.raises(ImageError, match="aspect ratio"):
            fit_size(height, width, factor, min_pixels, max_pixels)
        return
    got = fit_size(height, width, factor, min_pixels, max_pixels)
    assert got == expected
    assert got[0] % factor == 0 and got[1] % factor == 0 and min(got) >= factor


def test_the_store_keys_by_sha256_keeps_files_whole_and_names_a_missing_image(tmp_path):
    store = ImageStore(tmp_path / "images")
    blobs = [png_bytes(8, 8, i) for i in range(3)]
    keys = [store.put(b) for b in blobs]
    assert keys == [hashlib.sha256(b).hexdigest() for b in blobs]
    assert store.put(blobs[0]) == keys[0]                 # a second put of the same bytes: one file
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(keys)   # no .tmp left behind
    again = ImageStore(tmp_path / "images")               # a replay opening the run's images/
    assert [again.get(k) for k in keys] == blobs and again.hashes() == sorted(keys) and keys[1] in again
    with pytest.raises(KeyError, match="is not in the image store"):
        again.get("0" * 64)
    assert "0" * 64 not in again and ImageStore().hashes() == []


# (op, image) steps: acquire / release a reference, or get (encode on a miss).
STEPS = st.lists(st.tuples(st.sampled_from(["acquire", "release", "get"]), st.sampled_from("abcde")),
                 max_size=60)
ROWS = {"a": 3, "b": 5, "c": 2, "d": 6, "e": 4}


@settings(max_examples=200, deadline=None)
@given(steps=STEPS, capacity=st.integers(1, 12))
def test_the_encoder_cache_never_evicts_a_referenced_image_and_encodes_only_misses(steps, capacity):
    cache, refs, encoded, gets = EncoderCache(capacity_rows=capacity), {}, [], 0
    for op, key in steps:
        before = set(cache.entries)
        if op == "acquire":
            cache.acquire(key)
            refs[key] = refs.get(key, 0) + 1
        elif op == "release" and refs.get(key):
            cache.release(key)
            refs[key] -= 1
        elif op == "get":
            was_cached, num_encoded = key in cache, len(encoded)
            embeds = cache.get(key, lambda key=key: encoded.append(key) or torch.full((ROWS[key], 2), float(ord(key))))
            gets += 1
            assert embeds.shape == (ROWS[key], 2) and embeds[0, 0].item() == ord(key)   # its own rows
            assert len(encoded) == num_encoded + (not was_cached)                     # the tower ran on a miss only
            if not was_cached:   # a miss evicts: down to the bound, or to referenced entries only
                assert cache.rows <= capacity or all(refs.get(k) for k in cache.entries)
        if op != "get":
            assert before <= set(cache.entries)                  # only a get evicts
        assert all(k in cache for k in before if refs.get(k))   # a referenced image is never evicted
    assert cache.hits + cache.misses == gets and cache.misses == len(encoded)
    kinds = [e.kind for e in cache.take_events()]
    assert kinds.count("run") == cache.misses and kinds.count("hit") == cache.hits


def images_and_prompt(sizes: list[tuple[int, int]], text: int) -> tuple[list, list[int]]:
    images = [prepare_image(png_bytes(h, w, i), SETTINGS) for i, (h, w) in enumerate(sizes)]
    prompt: list[int] = []
    for image in images:
        prompt += list(range(text)) + placeholder_tokens(image, START, PAD, END)
    return images, prompt + [7] * text


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(8, 60), st.integers(8, 60)), min_size=1, max_size=3),
       text=st.integers(0, 9), cuts=st.lists(st.integers(1, 400), max_size=8))
def test_any_chunking_covers_every_image_row_exactly_once_in_order(sizes, text, cuts):
    images, prompt = images_and_prompt(sizes, text)
    found = PromptImages.build(prompt, images, PAD)
    assert [s.image.content_hash for s in found.spans] == [i.content_hash for i in images]
    assert all(all(prompt[i] == PAD for i in range(s.start, s.end)) for s in found.spans)
    bounds = sorted({0, len(prompt), *(c for c in cuts if c < len(prompt))})
    seen: dict[str, list[int]] = {}
    for offset, end in zip(bounds, bounds[1:]):
        for part in found.covered(offset, end - offset):
            assert 0 <= part.row and part.row + part.end - part.first <= end - offset
            assert prompt[offset + part.row] == PAD   # the chunk row the image row lands on is a placeholder
            seen.setdefault(part.span.image.content_hash, []).extend(range(part.first, part.end))
    assert {k: v for k, v in seen.items()} == {i.content_hash: list(range(i.num_tokens)) for i in images}
    assert found.positions.shape == (3, len(prompt))


def test_the_prefix_key_tells_same_sized_images_apart_and_keeps_the_text():
    (a,), prompt = images_and_prompt([(20, 24)], 3)
    b = prepare_image(png_bytes(20, 24, 99), SETTINGS)
    key_a = PromptImages.build(prompt, [a], PAD).prefix_key
    key_b = PromptImages.build(prompt, [b], PAD).prefix_key
    assert key_a != key_b and key_a == PromptImages.build(prompt, [a], PAD).prefix_key
    assert [k for k in key_a if k >= 0] == [t for t in prompt if t != PAD]   # text tokens unchanged
    with pytest.raises(ImageError, match="1 image placeholder run"):
        PromptImages.build(prompt, [a, b], PAD)
    with pytest.raises(ImageError, match="needs"):
        PromptImages.build(prompt[:4] + prompt[5:], [a], PAD)   # one placeholder short
