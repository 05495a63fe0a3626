"""Image bytes -> the vision tower's input: decode (Pillow), resize to the patch grid, normalize, patchify.

The steps of transformers' ``Qwen2VLImageProcessorPil`` (the processor Qwen3.5 checkpoints name),
written here: the size is rounded to a multiple of patch x merge keeping the aspect ratio and
the pixel count within [min_pixels, max_pixels] (``fit_size``), the RGB image is resized with
bicubic resampling, scaled to [0, 1], normalized per channel, then cut into patches laid out
in merge-block order with each patch repeated over the temporal patch size (a still image).

Bad input is an ``ImageError`` naming the problem (the API answers it with a 400); limits on
bytes and pixels are checked before any decoding work.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.model.vision_config import VisionConfig


class ImageError(ValueError):
    """An image a request carried cannot be used (not an image, too large, ...)."""


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 4              # per request
    max_bytes: int = 4 * 1024 * 1024  # per encoded image
    max_pixels: int = 4096 * 4096    # per decoded image, before resizing


@dataclass(frozen=True)
class ImageSettings:
    """How images are resized and normalized for one checkpoint."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def for_checkpoint(cls, vision: VisionConfig, directory: Path | None = None) -> "ImageSettings":
        """From the vision config, with ``preprocessor_config.json``'s pixel range and statistics if present."""
        factor = vision.patch_size * vision.spatial_merge_size
        raw: dict = {}
        path = directory / "preprocessor_config.json" if directory is not None else None
        if path is not None and path.is_file():
            try:
                raw = json.loads(path.read_text())
            except ValueError as err:
                raise ImageError(f"{path}: not valid JSON ({err})") from None
        size = raw.get("size") or {}
        return cls(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                   temporal_patch_size=vision.temporal_patch_size,
                   min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", factor * factor))),
                   max_pixels=int(size.get("longest_edge", raw.get("max_pixels", factor * factor * 256))),
                   mean=tuple(raw.get("image_mean", (0.5, 0.5, 0.5))), std=tuple(raw.get("image_std", (0.5, 0.5, 0.5))))


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


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fit_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) multiples of ``factor`` near the original aspect, pixels within [min, max]."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, limits: ImageLimits):
    """The decoded RGB Pillow image, or an ImageError (too many bytes or pixels, not an image)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))  # lazy: reads the header only
    except (UnidentifiedImageError, OSError) as err:
        raise ImageError(f"image data is not a decodable image ({err.__class__.__name__})") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}")
    try:
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(f"image data could not be decoded ({err})") from None


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
