"""Seeded test images: RGB PNG bytes with gradients plus noise (so resizing has something to round).

What workloads attach to their requests and what tests and benches send; the same seed gives
the same bytes, hence the same content hash, on every machine.
"""
from __future__ import annotations

import io

import numpy as np


def seeded_png(height: int, width: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / max(width - 1, 1), ys * 255 / max(height - 1, 1),
                     (xs + ys) * 127 / max(height + width - 2, 1)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
