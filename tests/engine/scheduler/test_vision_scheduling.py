"""Prompts with images through the real scheduler (tiny-vl): chunked like any prompt, keyed by image.

A request names its images by content hash (``features.images``); chunks of 16 that split an
image give the tokens of one whole-prompt forward; the same image again is a prefix hit and an
encoder-cache hit for the rows past the hit; a different image of the same size shares neither
(the prefix key holds the image hash: vllm#43587). Bad image requests are rejected before any forward.
"""
from __future__ import annotations

import pytest
import torch

from engine.cli.generate import generate
from engine.model.embedded import checkpoint_dir_of
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.multimodal.request_images import RequestImages
from engine.scheduler.loop import Scheduler
from engine.scheduler.request_features import RequestFeatures
from engine.scheduler.sampling import SamplingParams
from engine.serve.driver import TickDriver
from telemetry.levers import defaults
from tests.engine.model.vision_checkpoints import png_bytes

GREEDY = {"max_tokens": 8, "min_tokens": 8}


@pytest.fixture(scope="module")
def vl():
    torch.set_grad_enabled(False)
    model, _, tokenizer = load_model("tiny-vl")
    return model, tokenizer


def engine(model, levers=None):
    runner = ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=4)
    images = RequestImages.for_model(model, checkpoint_dir_of("tiny-vl"))
    rows: list = []
    return Scheduler(runner, levers or defaults(), emit=rows.append, prefix_cache=True, images=images), rows


def image_request(sched, request_id, data, text="hi"):
    """An image (48 x 96 pixels after resizing: 18 placeholder rows) then ``text``."""
    images = sched.images
    prompt = images.placeholders(data) + list(text.encode())
    key = images.store.put(data)
    return sched.submit(request_id, prompt, GREEDY, features=RequestFeatures(images=(key,)))


def run_alone(sched, *requests):
    TickDriver(sched).run()
    return [list(r.output_tokens) for r in requests]


def test_chunks_that_split_an_image_give_the_whole_prompt_tokens(vl):
    model, _ = vl
    sched, _ = engine(model, defaults().replace(max_prefill_tokens=16))
    data = png_bytes(48, 100, 1)
    request = image_request(sched, 0, data, text="a longer question")
    assert request.error is None and request.num_images == 1
    (tokens,) = run_alone(sched, request)
    prompt_images = sched.images.prompt_images(request.prompt_tokens, request.features.images)
    whole = generate(model, None, request.prompt_tokens, SamplingParams(max_tokens=8, min_tokens=8),
                     images=prompt_images)["tokens"]
    assert tokens == whole


def test_same_image_hits_prefix_and_encoder_cache_and_another_image_hits_neither(vl):
    model, _ = vl
    sched, _ = engine(model, defaults().replace(ssm_tail_ckpt=True))  # an SSM snapshot at token 16
    cache = sched.runner.encoder_cache
    first = image_request(sched, 0, png_bytes(48, 100, 1))
    run_alone(sched, first)
    # Cut at the tail boundary (16): the image's rows 15.. come from the cache in the second chunk.
    assert (cache.misses, cache.hits) == (1, 1) and first.prefix_hit_tokens == 0
    again = image_request(sched, 1, png_bytes(48, 100, 1))
    run_alone(sched, again)
    # The first block (16 tokens) is a prefix hit; the rest of the image is an encoder-cache hit.
    assert again.prefix_hit_tokens == 16, again.prefix_miss_reason
    assert (cache.misses, cache.hits) == (1, 2)
    other = image_request(sched, 2, png_bytes(48, 100, 2))  # same size, same placeholder ids
    run_alone(sched, other)
    assert other.prompt_tokens == first.prompt_tokens
    assert other.prefix_hit_tokens == 0 and cache.misses == 2


def test_bad_image_requests_are_rejected_before_any_forward(vl):
    model, _ = vl
    sched, _ = engine(model)
    data = png_bytes(48, 100, 1)
    prompt = sched.images.placeholders(data)
    missing = sched.submit(0, prompt, GREEDY, features=RequestFeatures(images=("ab" * 32,)))
    assert "not in the image store" in missing.error
    key = sched.images.store.put(data)
    short = sched.submit(1, prompt[:-3] + prompt[-1:], GREEDY, features=RequestFeatures(images=(key,)))
    assert "placeholder run" in short.error
    twice = sched.submit(2, prompt, GREEDY, features=RequestFeatures(images=(key, key)))
    assert "1 image placeholder run(s) for 2 image(s)" in twice.error
    text_only, _ = load_model("tiny")[0], None
    plain = Scheduler(ModelRunner.build(text_only, num_kv_blocks=8, num_ssm_slots=1), defaults())
    assert "takes no images" in plain.submit(0, [1, 2, 3], GREEDY, features=RequestFeatures(images=(key,))).error
    assert sched.tick == 0 and plain.tick == 0


def test_image_levers_cap_chunks_and_rows_show_spans_and_encoder_events(vl):
    from telemetry import events as ev

    model, _ = vl
    a, b = png_bytes(48, 100, 1), png_bytes(48, 100, 3)
    results = {}
    for name, levers in {"split": defaults().replace(max_prefill_tokens=16),
                         "whole": defaults().replace(max_prefill_tokens=32, image_whole=True),
                         "budget": defaults().replace(encoder_budget=18)}.items():
        sched, rows = engine(model, levers)
        images = sched.images
        prompt = list(b"see ") + images.placeholders(a) + list(b" and ") + images.placeholders(b) + list(b"?")
        keys = (images.store.put(a), images.store.put(b))
        request = sched.submit(0, prompt, GREEDY, features=RequestFeatures(images=keys))
        run_alone(sched, request)
        chunks = [r for r in rows if isinstance(r, ev.ChunkDecision)]
        encoder = [r for r in rows if isinstance(r, ev.GenericEvent) and r.kind in (ev.EVENT_ENCODER_RUN,
                                                                                        ev.EVENT_ENCODER_HIT)]
        results[name] = (list(request.output_tokens), chunks, encoder)
    tokens, chunks, encoder = results["split"]
    # "see " + <start> puts image a's rows at prompt 5..22, " and " + <start> image b's at 30..47.
    assert [c.image_spans for c in chunks] == ["0#0-11", "0#11-18 1#0-2", "1#2-18", None]
    assert [e.kind for e in encoder] == ["encoder_run", "encoder_hit", "encoder_run", "encoder_hit"]
    assert chunks[0].encoder_ns > 0 and chunks[1].encoder_ns > 0 and chunks[2].encoder_ns == 0
    whole_tokens, whole_chunks, _ = results["whole"]   # 32 would end inside image b: stop at 30
    assert [(c.cap_rule, c.length, c.image_spans) for c in whole_chunks] == [
        (ev.CAP_IMAGE_WHOLE, 30, "0#0-18"), (ev.CAP_REMAINING, 20, "1#0-18")]
    budget_tokens, budget_chunks, _ = results["budget"]  # a's 18 rows fit the budget, b's would pass it
    assert [(c.cap_rule, c.length) for c in budget_chunks] == [(ev.CAP_ENCODER_BUDGET, 30), (ev.CAP_REMAINING, 20)]
    assert tokens == whole_tokens == budget_tokens


def test_a_prefilling_request_holds_its_image_in_a_full_encoder_cache(vl):
    """An encoder cache too small for two images: the split image of the running prompt stays (the
    tower runs once for it), the finished one's image is evicted."""
    model, _ = vl
    sched, _ = engine(model, defaults().replace(max_prefill_tokens=16))
    sched.pools.encoder.capacity_rows = 20   # one 18-row image
    cache = sched.pools.encoder
    first = image_request(sched, 0, png_bytes(48, 100, 1))
    run_alone(sched, first)
    assert (cache.misses, cache.hits, cache.refs) == (1, 1, {})
    second = image_request(sched, 1, png_bytes(48, 100, 2))
    run_alone(sched, second)
    assert (cache.misses, cache.hits, cache.evictions) == (2, 2, 1) and list(cache.entries) == [
        second.features.images[0]]


def test_a_verify_forward_past_an_image_prompt_equals_a_decode_step(vl):
    """Verify (and draft) forwards sit past the prompt: with images, at index + delta (M-RoPE), as decode."""
    from engine.cache.sequence import SequenceState
    from engine.spec.verify import verify_forward

    model, _ = vl
    images = RequestImages.for_model(model, checkpoint_dir_of("tiny-vl"))
    data = png_bytes(48, 100, 1)
    prompt, prompt_images = images.prepend(list(b"what is it?"), [data])
    rows = []
    for step in ("decode", "verify"):
        runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=1)
        seq = SequenceState(0, images=prompt_images)
        runner.pools.admit(seq)
        token = int(runner.prefill_chunk(seq, prompt, 0, len(prompt), True).argmax())
        rows.append(runner.decode([seq], [token])[0] if step == "decode" else verify_forward(runner, seq, [token]).logits[0])
    assert prompt_images.delta < 0 and (rows[0] - rows[1]).abs().max().item() < 1e-4
