"""Chat ``image_url`` content parts -> the image bytes an engine request carries, and their placeholders.

An image part must be a base64 data URL (``data:image/png;base64,...``): remote URLs are refused
(the engine reaches no network). Each image is decoded here, within the server's limits, to learn
how many placeholder tokens it takes; a bad one is a 400 naming the part and the problem, so
nothing reaches the engine. Torch-free (the frontend process).
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

from engine.api.errors import bad_request
from engine.multimodal.limits import ImageError, ImagePolicy, image_tokens

DATA_URL_PREFIX = "data:"


def image_reader(policy: ImagePolicy | None, images: list[tuple[bytes, int]]) -> Callable:
    """``Message.text``'s ``image_text``: appends (the part's bytes, its placeholder count) to ``images``
    and returns its placeholder text."""

    def image_text(part) -> str:
        where = f"messages: image {len(images) + 1}"
        if policy is None:
            raise bad_request(f"{where}: this model takes no images (its checkpoint has no vision tower)",
                              "messages", "images_not_supported")
        if len(images) >= policy.limits.max_images:
            raise bad_request(f"{where}: at most {policy.limits.max_images} images per request", "messages",
                              "too_many_images")
        data = data_url_bytes(part.image_url.url, where)
        try:
            tokens = image_tokens(data, policy.settings, policy.limits)
        except ImageError as exc:
            raise bad_request(f"{where}: {exc}", "messages", "invalid_image") from None
        images.append((data, tokens))
        return policy.placeholder_text(tokens)

    return image_text


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a ``data:<mime>;base64,<payload>`` URL, or a 400 saying what is wrong with it."""
    if not url.startswith(DATA_URL_PREFIX):
        scheme = url.split(":", 1)[0] if ":" in url else "no scheme"
        raise bad_request(f"{where}: image_url must be a base64 data URL (data:image/...;base64,...); "
                          f"{scheme!s:.20} URLs are not fetched (this server reaches no network)", "messages",
                          "remote_image_url")
    header, sep, payload = url[len(DATA_URL_PREFIX):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise bad_request(f"{where}: the data URL is not base64-encoded (expected data:<type>;base64,<data>)",
                          "messages", "invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the data URL's payload is not valid base64", "messages",
                          "invalid_image") from None
