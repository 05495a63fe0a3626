"""What an image may be, checked without torch: limits, decoding, the resized size and token count.

The API frontend (no torch) answers a bad image with a 400 from here before anything reaches the
engine; the engine's preprocessing (``preprocess.py``) uses the same decode and size rules.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.model.vision_config import VisionConfig


class ImageError(ValueError):
    """An image a request carried cannot be used (not an image, too large, ...)."""


MAX_IMAGES_CEILING = 64   # --limit-mm-per-prompt's highest image count: each one is encoded at submit


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 4              # per request (serve --limit-mm-per-prompt '{"image": N}')
    max_bytes: int = 512 * 1024      # per encoded image (base64 makes it 4/3 of that: under the 1 MiB body)
    max_pixels: int = 4096 * 4096    # per decoded image, before resizing

    def to_dict(self) -> dict[str, int]:
        return {"max_images": self.max_images, "max_bytes": self.max_bytes, "max_pixels": self.max_pixels}

    @classmethod
    def from_dict(cls, raw: object) -> "ImageLimits":
        """A run config's ``image_limits`` (what a replay must accept again); an ImageError names a bad one."""
        if not isinstance(raw, dict):
            raise ImageError(f"image_limits: not an object ({type(raw).__name__})")
        values = {}
        for name in ("max_images", "max_bytes", "max_pixels"):
            if name in raw:
                value = raw[name]
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 40:
                    raise ImageError(f"image_limits.{name}: not a count ({str(value)[:40]})")
                values[name] = value
        return cls(**values)


def parse_mm_limits(text: str) -> ImageLimits:
    """``--limit-mm-per-prompt`` as vLLM spells it: a JSON object of modality -> most items per request.
    Only images here (``{"image": N}``, 0 <= N <= 64; 0 refuses images); anything else is an ImageError."""
    if len(text) > 200:   # also keeps json's recursion on deep nesting out of reach
        raise ImageError(f"{len(text)} characters: too long for a JSON object like '{{\"image\": 2}}'")
    try:
        raw = json.loads(text)
    except ValueError:
        raise ImageError(f"not a JSON object: {text[:60]!r} (e.g. '{{\"image\": 2}}')") from None
    if not isinstance(raw, dict):
        raise ImageError(f"not a JSON object: {text[:60]!r} (e.g. '{{\"image\": 2}}')")
    others = sorted(set(raw) - {"image"})
    if others:
        raise ImageError(f"only image inputs are served, not {', '.join(map(repr, others))[:80]}")
    count = raw.get("image", ImageLimits.max_images)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_IMAGES_CEILING:
        raise ImageError(f"image: the count must be an integer 0-{MAX_IMAGES_CEILING}, got {str(count)[:40]}")
    return ImageLimits(max_images=count)


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


def image_tokens(data: bytes, settings: ImageSettings, limits: ImageLimits) -> int:
    """How many placeholder tokens the image takes (decoding it checks the limits)."""
    image = decode_image(data, limits)
    factor = settings.patch_size * settings.merge_size
    height, width = fit_size(image.height, image.width, factor, settings.min_pixels, settings.max_pixels)
    return (height // factor) * (width // factor)


@dataclass(frozen=True)
class ImagePolicy:
    """What the API frontend needs to accept images for a checkpoint with a vision tower (torch-free)."""

    settings: ImageSettings
    limits: ImageLimits
    start_token: str      # the placeholder texts the tokenizer maps to the config's ids
    pad_token: str
    end_token: str
    pad_id: int

    def placeholder_text(self, num_tokens: int) -> str:
        return self.start_token + self.pad_token * num_tokens + self.end_token
