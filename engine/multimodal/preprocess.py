"""Image bytes -> the vision tower's input: decode (Pillow), resize to the patch grid, normalize, patchify.

The steps of transformers' ``Qwen2VLImageProcessorPil`` (the processor Qwen3.5 checkpoints name),
written here: the size is rounded to a multiple of patch x merge keeping the aspect ratio and
the pixel count within [min_pixels, max_pixels] (``fit_size``), the RGB image is resized with
bicubic resampling, scaled to [0, 1], normalized per channel, then cut into patches laid out
in merge-block order with each patch repeated over the temporal patch size (a still image).

Bad input is an ``ImageError`` naming the problem (``limits.py``: limits on bytes and pixels are
checked before any decoding work).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.multimodal.limits import ImageLimits, ImageSettings, content_hash, decode_image, fit_size


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: its content hash, patches [t * h * w, patch_dim] and grid."""

    content_hash: str             # sha256 of the encoded bytes: the encoder cache and prefix keys
    patches: torch.Tensor         # float32, merge-block order
    grid: tuple[int, int, int]    # (t, h, w) in patches
    merge_size: int

    @property
    def merged_grid(self) -> tuple[int, int]:
        """(rows, cols) of placeholder tokens: the patch grid over the merge size."""
        return self.grid[1] // self.merge_size, self.grid[2] // self.merge_size

    @property
    def num_tokens(self) -> int:
        rows, cols = self.merged_grid
        return self.grid[0] * rows * cols


def prepare_image(data: bytes, settings: ImageSettings, limits: ImageLimits = ImageLimits()) -> PreparedImage:
    """Encoded image bytes -> ``PreparedImage``."""
    from PIL import Image

    image = decode_image(data, limits)
    factor = settings.patch_size * settings.merge_size
    height, width = fit_size(image.height, image.width, factor, settings.min_pixels, settings.max_pixels)
    resized = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)  # [H, W, 3]
    pixels = (resized / 255.0 - np.asarray(settings.mean, np.float32)) / np.asarray(settings.std, np.float32)
    patches, grid = patchify(torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)),
                             settings)
    return PreparedImage(content_hash(data), patches, grid, settings.merge_size)


def patchify(pixels: torch.Tensor, settings: ImageSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """pixels [C, H, W] -> patches [h * w, C * T * P * P] in merge-block order, grid (1, h, w)."""
    channels, height, width = pixels.shape
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    h, w = height // p, width // p
    blocks = pixels.reshape(channels, h // m, m, p, w // m, m, p)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)  # [h/m, w/m, m, m, C, P, P]
    # A still image fills every temporal slot of the patch with the same frame.
    patches = blocks[:, :, :, :, :, None].expand(*blocks.shape[:5], t, p, p)  # [.., C, T, P, P]
    return patches.reshape(h * w, channels * t * p * p).contiguous(), (1, h, w)
