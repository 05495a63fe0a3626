"""Chunk caps for prompts with images: the per-tick encoder budget and keeping an image whole.

Pure: the spans come in as (first placeholder index, end, already encoded) and the planned chunk
[offset, offset + length) as ints; the result is the new length and the cap that set it (None
when neither changed it). Applied after ``chunk_plan.plan_chunk`` (a cap only shortens a chunk,
and never to zero: an image at the chunk's start always runs, so a prompt always progresses).

- ``image_whole``: a chunk that would end inside an image stops before that image, when the
  image starts after the chunk's offset (an image longer than the chunk's cap is split anyway).
- ``encoder_budget`` (rows per tick, 0: none): images the chunk covers that are not encoded yet
  cost their rows; the first one that would pass the budget ends the chunk before it.
"""
from __future__ import annotations

from collections.abc import Sequence

from telemetry.events import CAP_ENCODER_BUDGET, CAP_IMAGE_WHOLE

Span = tuple[int, int, bool]   # (start, end, encoded): an image's placeholder rows in the prompt


def cap_for_images(offset: int, length: int, spans: Sequence[Span], *, encoder_budget: int,
                   image_whole: bool) -> tuple[int, str | None]:
    """(length, cap rule or None) for the chunk [offset, offset + length)."""
    end, rule = offset + length, None
    if encoder_budget > 0:
        spent = 0
        for start, stop, encoded in spans:
            if encoded or stop <= offset or start >= end:
                continue
            spent += stop - start
            if spent > encoder_budget and start > offset:
                end, rule = start, CAP_ENCODER_BUDGET
                break
    if image_whole:
        for start, stop, _ in spans:
            if start < end < stop and start > offset:
                end, rule = start, CAP_IMAGE_WHOLE
                break
    return end - offset, rule


def image_spans(images, encoded) -> list[Span]:
    """A request's ``PromptImages`` as spans, ``encoded(content_hash)`` saying which are cached."""
    if images is None:
        return []
    return [(s.start, s.end, encoded(s.image.content_hash)) for s in images.spans]
