"""Attach images to a workload's requests, so a run on a vision checkpoint exercises them.

A seeded share of the requests gets one image in front of its prompt, drawn from a few seeded
images of the same size (repeats hit the encoder cache; different images of the same size must
never share a prefix). The image bytes go to the engine's image store, the request names them by
content hash (``features.images``), as an API request with an image does. The chat workload
places the same pool's images in its chat template instead (``chat_images``).
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

from typing import Any

from engine.multimodal.limits import image_tokens
from engine.multimodal.request_images import RequestImages
from engine.multimodal.seeded_image import seeded_png
from engine.workload.request import RequestSpec

NUM_IMAGES = 3           # distinct images a workload draws from
IMAGE_SIZE = (48, 100)   # pixels (tiny-vl: 3 x 6 = 18 placeholder tokens)


def with_images(specs: Iterable[RequestSpec], images: RequestImages, share: float, seed: int) -> Iterator[RequestSpec]:
    """``specs`` with an image prepended to a seeded ``share`` of them (lazy: endless workloads too).

    A conversation's turns share the image its first turn drew (or its lack of one): turn k resends
    turn k-1's prompt, and an image drawn per turn would end that shared prefix at its first token."""
    rng = random.Random(seed * 1_000_003 + 28)
    pool = image_pool(seed)
    placeholders = [images.placeholders(data) for data in pool]   # the store keeps each image once
    keys = [images.store.put(data) for data in pool]
    by_conversation: dict[int, int | None] = {}   # conversation id -> its image's index in the pool
    for spec in specs:
        conversation = spec.conversation_id
        if conversation is not None and conversation in by_conversation:
            pick = by_conversation[conversation]
        else:
            pick = None if rng.random() >= share else rng.randrange(NUM_IMAGES)
            if conversation is not None:
                by_conversation[conversation] = pick
        if pick is None:
            yield spec
            continue
        features = dict(spec.features or {})
        features["images"] = [keys[pick]]
        yield RequestSpec(spec.request_id, spec.arrival_s, placeholders[pick] + list(spec.prompt_tokens), spec.sampling,
                          spec.conversation_id, spec.turn, spec.arrival_tick, features, spec.grammar)


def image_pool(seed: int) -> list[bytes]:
    """The workload's seeded PNGs, all of ``IMAGE_SIZE``."""
    return [seeded_png(*IMAGE_SIZE, seed * 31 + i) for i in range(NUM_IMAGES)]


def chat_images(images: RequestImages, tokenizer: Any, seed: int) -> list[tuple[str, str]]:
    """(placeholder text, content hash) of each pooled image, kept in the store: what the chat workload
    puts in a user's turn, in the text the API's frontend writes for an ``image_url`` part."""
    policy = images.policy(tokenizer)
    return [(policy.placeholder_text(image_tokens(data, policy.settings, policy.limits)), images.store.put(data))
            for data in image_pool(seed)]
