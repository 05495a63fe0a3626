"""A request's images, from content hashes to ``PromptImages``: what the scheduler runs at submit.

``RequestImages`` belongs to an engine whose checkpoint has a vision tower: it holds the image
store the hashes are looked up in, the checkpoint's preprocessing settings and the limits. A
request's images must be in the store, decode within the limits and match the prompt's
placeholder runs one for one; anything else is an ``ImageError`` naming it (the scheduler
rejects the request with it, before any forward).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.model.vision_config import VisionConfig
from engine.multimodal.image_store import ImageStore
from engine.model.tokenizer import IMAGE_PAD, VISION_END, VISION_START
from engine.multimodal.limits import ImageError, ImageLimits, ImagePolicy, ImageSettings
from engine.multimodal.preprocess import PreparedImage, prepare_image
from engine.multimodal.prompt_images import PromptImages, placeholder_tokens


class RequestImages:
    def __init__(self, vision: VisionConfig, settings: ImageSettings, store: ImageStore | None = None,
                 limits: ImageLimits = ImageLimits()):
        self.vision, self.settings, self.limits = vision, settings, limits
        self.store = store if store is not None else ImageStore()

    @classmethod
    def for_model(cls, model, checkpoint_dir: Path | None, store: ImageStore | None = None,
                  limits: ImageLimits = ImageLimits()) -> "RequestImages | None":
        """For a model with a vision tower (None without one)."""
        vision = getattr(model, "vision_config", None)
        if vision is None:
            return None
        return cls(vision, ImageSettings.for_checkpoint(vision, checkpoint_dir), store, limits)

    def policy(self, tokenizer) -> ImagePolicy:
        """What the API frontend checks images with: the limits and the placeholder texts, which must be
        the tokenizer's names for the config's token ids."""
        v = self.vision
        names = []
        for text, token in ((VISION_START, v.vision_start_token_id), (IMAGE_PAD, v.image_token_id),
                            (VISION_END, v.vision_end_token_id)):
            if tokenizer is None or tokenizer.token_id(text) != token:
                raise ImageError(f"the tokenizer does not map {text} to the config's id {token}: images cannot "
                                 f"be placed in chat text")
            names.append(text)
        return ImagePolicy(self.settings, self.limits, *names, pad_id=v.image_token_id)

    def prepare(self, data: bytes) -> PreparedImage:
        return prepare_image(data, self.settings, self.limits)

    def prompt_images(self, prompt: Sequence[int], hashes: Sequence[str]) -> PromptImages:
        """The prompt's images (``features.images``) matched to its placeholder runs."""
        if len(hashes) > self.limits.max_images:
            raise ImageError(f"{len(hashes)} images, over the limit of {self.limits.max_images} per request")
        prepared = []
        for key in hashes:
            try:
                data = self.store.get(key)
            except KeyError as err:
                raise ImageError(str(err.args[0])) from None
            prepared.append(self.prepare(data))
        return PromptImages.build(prompt, prepared, self.vision.image_token_id)

    def prepend(self, prompt: Sequence[int], images: Sequence[bytes]) -> tuple[list[int], PromptImages]:
        """(each image's placeholders, then ``prompt``; its ``PromptImages``), the images kept in the store."""
        tokens: list[int] = []
        for data in images:
            tokens += self.placeholders(data)
        tokens += prompt
        return tokens, self.prompt_images(tokens, [self.store.put(data) for data in images])

    def placeholders(self, data: bytes) -> list[int]:
        """The prompt tokens that stand for the image ``data``: start, one pad per embedding row, end."""
        v = self.vision
        return placeholder_tokens(self.prepare(data), v.vision_start_token_id, v.image_token_id, v.vision_end_token_id)
