"""A prompt's images: where each one's placeholder tokens sit, and the prompt's M-RoPE positions.

Built once per request at admission (``PromptImages.build``); every chunk then slices what it
needs: its rows' positions (``rope_positions``) and which placeholder rows of which image it
covers (``covered``), so a chunk may split an image and still get the right embeddings.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.mrope import prompt_positions
from engine.multimodal.limits import ImageError
from engine.multimodal.preprocess import PreparedImage


@dataclass(frozen=True)
class ImageSpan:
    start: int            # prompt index of the image's first placeholder token
    image: PreparedImage

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


@dataclass(frozen=True)
class CoveredSpan:
    """The part of one image a chunk covers: placeholder rows [first, end) of the image's embeddings,
    at chunk rows [row, row + end - first)."""

    span: ImageSpan
    first: int
    end: int
    row: int


@dataclass(frozen=True)
class PromptImages:
    spans: tuple[ImageSpan, ...]
    positions: torch.Tensor   # [3, prompt length] long
    delta: int                # tokens after the prompt sit at index + delta
    # The prompt as the prefix cache keys it: each placeholder token replaced by a negative value
    # from its image's content hash and its index in the image, so blocks of different images
    # (same size, same placeholder ids) never share a key (vllm#43587 is this bug).
    prefix_key: tuple[int, ...] = ()

    @classmethod
    def build(cls, prompt: Sequence[int], images: Sequence[PreparedImage], image_token_id: int) -> "PromptImages":
        """Match the prompt's runs of ``image_token_id`` to ``images`` in order; each run must be
        exactly as long as its image's token count."""
        runs: list[tuple[int, int]] = []
        index = 0
        while index < len(prompt):
            if prompt[index] == image_token_id:
                start = index
                while index < len(prompt) and prompt[index] == image_token_id:
                    index += 1
                runs.append((start, index))
            else:
                index += 1
        if len(runs) != len(images):
            raise ImageError(f"the prompt has {len(runs)} image placeholder run(s) for {len(images)} image(s)")
        spans = []
        for (start, end), image in zip(runs, images):
            if end - start != image.num_tokens:
                raise ImageError(f"an image placeholder run at token {start} has {end - start} tokens, its image "
                                 f"needs {image.num_tokens}")
            spans.append(ImageSpan(start, image))
        positions, delta = prompt_positions(len(prompt), [(s.start, *s.image.merged_grid) for s in spans])
        key = list(prompt)
        for span in spans:
            image_key = int(span.image.content_hash[:10], 16) << 20  # 40 hash bits, 20 for the row
            key[span.start: span.end] = [-1 - (image_key + row) for row in range(span.image.num_tokens)]
        return cls(tuple(spans), positions, delta, tuple(key))

    @property
    def hashes(self) -> list[str]:
        return [span.image.content_hash for span in self.spans]

    def rope_positions(self, offset: int, length: int) -> torch.Tensor:
        """[3, length]: positions of prompt rows [offset, offset + length)."""
        return self.positions[:, offset: offset + length]

    def covered(self, offset: int, length: int) -> list[CoveredSpan]:
        """The image rows prompt[offset:offset + length] holds, image by image."""
        out = []
        for span in self.spans:
            first, end = max(offset, span.start), min(offset + length, span.end)
            if first < end:
                out.append(CoveredSpan(span, first - span.start, end - span.start, first - offset))
        return out


def placeholder_tokens(image: PreparedImage, start_id: int, image_id: int, end_id: int) -> list[int]:
    """<vision_start> <image_pad> x tokens <vision_end>: what stands for one image in a prompt."""
    return [start_id, *[image_id] * image.num_tokens, end_id]
