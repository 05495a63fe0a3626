"""The chat workload with images (what ``./run.sh`` serves on tiny-chat's seeded tower): a seeded share
of the requests opens its user turn with an image, placed as the API places an ``image_url`` part;
the text requests are the same at any share; and a short served run records encoder runs, encoder-
cache hits and chunk rows with image spans, which the Live page's encoder lane reads."""
from __future__ import annotations

import base64
import json
import sqlite3
from dataclasses import replace
from types import SimpleNamespace

import pytest

from engine.api.chat_template import ChatTemplate
from engine.api.parse import EngineInfo, chat_requests
from engine.api.protocol import ChatCompletionRequest
from engine.model.loader import load_tokenizer, read_vision
from engine.model.tiny_chat import TINY_CHAT_DIR
from engine.multimodal.limits import ImageSettings
from engine.multimodal.request_images import RequestImages
from engine.serve.workload_feed import WorkloadFeed
from engine.workload.chat import ChatWorkload, with_image_first
from engine.workload.images import chat_images, image_pool, with_images
from engine.workload.multiturn import MultiTurnWorkload
from engine.workload.request import WorkloadError
from telemetry import events as ev
from tests.engine.ep_process import engine

TOKENIZER = load_tokenizer(TINY_CHAT_DIR)
TEMPLATE = ChatTemplate.for_checkpoint(TINY_CHAT_DIR)
VISION = read_vision(TINY_CHAT_DIR)
SEED, NUM_REQUESTS = 0, 12


def request_images() -> RequestImages:
    return RequestImages(VISION, ImageSettings.for_checkpoint(VISION, TINY_CHAT_DIR))


def chat(share: float, images=()) -> list:
    return ChatWorkload(tokenizer=TOKENIZER, template=TEMPLATE, images=images, num_requests=NUM_REQUESTS,
                        seed=SEED, image_share=share).requests()


def test_a_share_of_requests_opens_its_user_turn_with_an_image_and_the_rest_are_unchanged():
    pool = chat_images(request_images(), TOKENIZER, SEED)
    plain, mixed = chat(0.0), chat(0.5, pool)
    with_image = [s for s in mixed if s.features.get("images")]
    assert 0 < len(with_image) < NUM_REQUESTS
    start, pad, end = (TOKENIZER.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    user_turn = TOKENIZER.encode("<|im_start|>user\n")
    for before, after in zip(plain, mixed):
        if not after.features.get("images"):
            assert after.prompt_tokens == before.prompt_tokens and after.sampling == before.sampling
            continue
        (key,) = after.features["images"]
        placeholder = next(text for text, k in pool if k == key)
        tokens = TOKENIZER.encode(placeholder)
        assert tokens[0] == start and tokens[-1] == end and set(tokens[1:-1]) == {pad}
        # The image opens the last user turn; without it the prompt is the text request's.
        at = max(i for i in range(len(after.prompt_tokens)) if after.prompt_tokens[i:i + len(user_turn)] == user_turn)
        at += len(user_turn)
        assert after.prompt_tokens[at:at + len(tokens)] == tokens
        assert after.prompt_tokens[:at] + after.prompt_tokens[at + len(tokens):] == before.prompt_tokens
    with pytest.raises(WorkloadError, match="needs images"):
        chat(0.5)


def test_the_image_is_placed_as_the_api_places_an_image_url_part():
    images = request_images()
    data = image_pool(SEED)[0]
    placeholder, key = chat_images(images, TOKENIZER, SEED)[0]
    info = EngineInfo(model_name="tiny-chat", vocab_size=272, max_context=4096, num_kv_blocks=64, block_size=16,
                      tokenizer=TOKENIZER, chat_template=TEMPLATE, has_tool_call_token=True,
                      images=images.policy(TOKENIZER))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    body = ChatCompletionRequest.model_validate({"model": "tiny-chat", "chat_template_kwargs": {"enable_thinking": True},
                                                 "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "List 3 colors."}]}]})
    (api,) = chat_requests(info, body)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "List 3 colors."}]
    assert TOKENIZER.encode(TEMPLATE.render(with_image_first(messages, placeholder), None,
                                            enable_thinking=True)) == api.prompt_tokens
    assert api.features.images == (key,)


def test_an_image_share_on_a_model_without_a_tower_is_a_one_line_error():
    args = SimpleNamespace(workload="chat", requests=4, rate=50.0, seed=1, image_share=0.5)
    setup = SimpleNamespace(tokenizer=TOKENIZER, checkpoint_dir=None, model_name="tiny",
                            scheduler=SimpleNamespace(images=None))
    with pytest.raises(WorkloadError, match="no vision tower"):
        WorkloadFeed.from_args(args, setup)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """What ./run.sh serves, short: tiny-chat, the chat workload, its default image share."""
    run_dir = tmp_path_factory.mktemp("chat-images")
    done = engine("serve", "--model", "tiny-chat", "--workload", "chat", "--run-dir", str(run_dir), "--requests",
                  str(NUM_REQUESTS), "--rate", "1000", "--seed", str(SEED), "--threads", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir / "telemetry.db"


def test_the_default_run_exercises_the_encoder_its_cache_and_image_spans(served):
    db = sqlite3.connect(served)
    db.row_factory = sqlite3.Row
    requests = db.execute("SELECT num_images, status, features FROM requests ORDER BY request_id").fetchall()
    assert [r["status"] for r in requests] == ["finished"] * NUM_REQUESTS
    # The workload's default share (0.5 on a checkpoint with a tower), drawn as in-process.
    expected = [s.features.get("images", []) for s in chat(0.5, chat_images(request_images(), TOKENIZER, SEED))]
    assert [r["num_images"] for r in requests] == [len(x) for x in expected]
    assert [json.loads(r["features"]).get("images", []) for r in requests] == expected
    kinds = [r["kind"] for r in db.execute("SELECT kind FROM events WHERE kind IN (?, ?)",
                                           (ev.EVENT_ENCODER_RUN, ev.EVENT_ENCODER_HIT))]
    distinct = {key for keys in expected for key in keys}
    # Each pooled image ran the tower once (a miss); its repeats came from the cache (hits).
    assert 1 <= kinds.count(ev.EVENT_ENCODER_RUN) <= len(distinct)
    assert kinds.count(ev.EVENT_ENCODER_HIT) >= 1
    spans = [r["image_spans"] for r in db.execute("SELECT image_spans FROM chunks WHERE image_spans IS NOT NULL")]
    assert spans and all("#" in span for span in spans)
    # The Live timeline's encoder lane reads the same events.
    from dashboard.queries.live import timeline_window
    run_id = db.execute("SELECT run_id FROM runs").fetchone()["run_id"]
    window = timeline_window(served, run_id, 3600.0)
    assert set(window.encoder["kind"]) == {ev.EVENT_ENCODER_RUN, ev.EVENT_ENCODER_HIT}


def test_a_conversations_turns_share_its_first_turns_image_so_each_turn_still_prefixes_the_next():
    """--workload multiturn on a vision checkpoint: an image drawn per turn ended each turn's shared
    prefix at its first token; a conversation keeps the image (or none) its first turn drew."""
    specs = MultiTurnWorkload(vocab_size=250, num_conversations=16, num_turns=3, seed=SEED).requests()
    attached = list(with_images(specs, request_images(), 0.5, SEED))
    by_turn = {(s.conversation_id, s.turn): s for s in attached}
    drawn: dict[int, set] = {}
    for spec in attached:
        drawn.setdefault(spec.conversation_id, set()).add(tuple((spec.features or {}).get("images", ())))
        if spec.turn:
            earlier = by_turn[(spec.conversation_id, spec.turn - 1)]
            assert spec.prompt_tokens[:len(earlier.prompt_tokens)] == earlier.prompt_tokens
    assert all(len(images) == 1 for images in drawn.values())
    assert {bool(next(iter(images))) for images in drawn.values()} == {True, False}  # some with, some without
    # Requests outside a conversation still draw one by one, as before.
    lone = [replace(s, conversation_id=None, turn=0) for s in specs]
    assert len({tuple((s.features or {}).get("images", ())) for s in with_images(lone, request_images(), 0.5, SEED)}) > 2
