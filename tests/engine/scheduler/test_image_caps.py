"""The image chunk caps (pure): the encoder budget and keeping an image whole."""
from __future__ import annotations

from hypothesis import given, strategies as st

from engine.scheduler.image_caps import cap_for_images
from telemetry import events as ev

SPANS = [(4, 20, False), (24, 40, False), (44, 60, True)]   # two images to encode, one cached


def test_image_whole_stops_before_an_image_the_chunk_would_split():
    assert cap_for_images(0, 10, SPANS, encoder_budget=0, image_whole=True) == (4, ev.CAP_IMAGE_WHOLE)
    assert cap_for_images(0, 22, SPANS, encoder_budget=0, image_whole=True) == (22, None)   # ends between images
    assert cap_for_images(6, 10, SPANS, encoder_budget=0, image_whole=False) == (10, None)
    # An image at the chunk's start that the cap splits anyway: no progress otherwise.
    assert cap_for_images(4, 10, SPANS, encoder_budget=0, image_whole=True) == (10, None)


def test_the_encoder_budget_stops_before_the_image_that_would_pass_it():
    assert cap_for_images(0, 64, SPANS, encoder_budget=16, image_whole=False) == (24, ev.CAP_ENCODER_BUDGET)
    assert cap_for_images(0, 64, SPANS, encoder_budget=32, image_whole=False) == (64, None)  # cached: free
    assert cap_for_images(4, 64, SPANS, encoder_budget=8, image_whole=False) == (20, ev.CAP_ENCODER_BUDGET)
    assert cap_for_images(0, 64, SPANS, encoder_budget=0, image_whole=False) == (64, None)  # 0: no budget


@given(st.integers(0, 70), st.integers(1, 80), st.integers(0, 40), st.booleans())
def test_a_cap_only_shortens_and_always_progresses(offset, length, budget, whole):
    new, rule = cap_for_images(offset, length, SPANS, encoder_budget=budget, image_whole=whole)
    assert 1 <= new <= length and (rule is None) == (new == length)
