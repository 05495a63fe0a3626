"""Images through the official ``openai`` client in front of tiny-vl.

A chat with an image (a base64 data URL) streams; the same image again is a prefix hit and an
encoder-cache hit for the image rows past the hit; a different image of the same size is
neither. Bad images (not base64, not an image, too many pixels, too many images, a remote URL)
are each a 400 naming the problem, and no request reaches the engine.
"""
from __future__ import annotations

import base64

import openai
import pytest

from api_server_helpers import started_server
from serve_process import kill_quietly, stop, wait_for
from engine.api.chat_template import ChatTemplate
from engine.model.embedded import checkpoint_dir_of
from engine.model.loader import load_tokenizer
from telemetry import events as ev
from tests.engine.model.vision_checkpoints import png_bytes

IMAGE_SIZE = (48, 100)   # 3 x 6 = 18 placeholder rows in tiny-vl


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    # SSM snapshots at each prompt's last full block: what a later turn's prefix hit restores.
    server = started_server(tmp_path_factory.mktemp("api-vl"), "--model", "tiny-vl", "--kv-blocks", "64",
                            env_extra={"CHUNKSCOPE_SSM_TAIL_CKPT": "1"})
    yield server
    kill_quietly(server.proc)   # the replay test stops it cleanly first


def solid_png(height: int, width: int) -> bytes:
    """A one-colour PNG: many pixels in a few kB."""
    import io
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(data: bytes, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": data_url(data)}}]}]


def text_for_a_second_turn_hit() -> str:
    """Text before the image such that the first turn's prompt, less the empty think block a later
    turn's history drops (6 tokens), still reaches its last full block: the second turn's prefix hit."""
    directory = checkpoint_dir_of("tiny-vl")
    tokenizer, template = load_tokenizer(directory), ChatTemplate.for_checkpoint(directory)
    image = "<|vision_start|>" + "<|image_pad|>" * 18 + "<|vision_end|>"
    for size in range(1, 17):
        length = len(tokenizer.encode(template.render([{"role": "user", "content": "q" * size + image}], None,
                                                      enable_thinking=False)))
        if (length - 1) % 16 >= 6:
            return "q" * size
    raise AssertionError("no text length leaves the last full block before the think block")


def events_of(server, request_id: int) -> list[str]:
    return [r["kind"] for r in server.rows("SELECT kind FROM events WHERE request_id = ? AND kind IN (?, ?) "
                                           "ORDER BY id", (request_id, ev.EVENT_ENCODER_RUN, ev.EVENT_ENCODER_HIT))]


def test_streams_then_the_same_image_hits_and_another_image_does_not(vl_server):
    client, text = vl_server.client(), text_for_a_second_turn_hit()
    first, other = png_bytes(*IMAGE_SIZE, 1), png_bytes(*IMAGE_SIZE, 2)
    stream = client.chat.completions.create(model="tiny-vl", messages=image_message(first, text), max_tokens=4,
                                            temperature=0, stream=True)
    reply = "".join(c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content)
    assert reply
    # The next turn repeats the conversation and sends the same image again.
    follow_up = image_message(first, text) + [{"role": "assistant", "content": reply}] + image_message(first, "again")
    client.chat.completions.create(model="tiny-vl", messages=follow_up, max_tokens=4, temperature=0)
    client.chat.completions.create(model="tiny-vl", messages=image_message(other, text), max_tokens=4, temperature=0)
    rows = wait_for(lambda: (lambda r: r if len(r) == 3 and all(x["status"] == ev.REQ_FINISHED for x in r) else None)(
        vl_server.rows("SELECT request_id, status, prefix_hit_tokens, num_images FROM requests ORDER BY request_id")),
        "three finished image requests")
    assert [r["num_images"] for r in rows] == [1, 2, 1]
    ids = [r["request_id"] for r in rows]
    events = wait_for(lambda: [events_of(vl_server, i) for i in ids] if events_of(vl_server, ids[2]) else None,
                      "the third request's encoder events")
    assert rows[0]["prefix_hit_tokens"] == 0 and events[0] == [ev.EVENT_ENCODER_RUN]
    # The first turn (its image included) is a prefix hit; the repeated image's rows come from the cache.
    assert rows[1]["prefix_hit_tokens"] > 0 and events[1] and set(events[1]) == {ev.EVENT_ENCODER_HIT}
    # Same size, same placeholder ids, another image: no hit reaches its rows, and the tower runs.
    image_start = len(text) + 7   # <|im_start|> "user\n" (5 bytes) text <|vision_start|>
    assert rows[2]["prefix_hit_tokens"] <= image_start and events[2][0] == ev.EVENT_ENCODER_RUN
    # The Live timeline's encoder lane reads the same events.
    from dashboard.queries.live import timeline_window

    run_id = vl_server.rows("SELECT run_id FROM runs")[0]["run_id"]
    window = timeline_window(vl_server.db, run_id, 3600.0)
    assert set(window.encoder["kind"]) == {ev.EVENT_ENCODER_RUN, ev.EVENT_ENCODER_HIT}


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "not fetched"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not base64@@@"}}], "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": data_url(b"GIF89a but not really")}}], "not a decodable image"),
    ([{"type": "image_url", "image_url": {"url": data_url(solid_png(4100, 4100))}}], "pixels, over the limit"),
    ([{"type": "image_url", "image_url": {"url": data_url(png_bytes(460, 460, 0))}}], "bytes, over the limit"),
    ([{"type": "image_url", "image_url": {"url": data_url(png_bytes(16, 16, i))}} for i in range(5)],
     "at most 4 images"),
])
def test_bad_images_are_400s_naming_the_problem_and_reach_no_forward(vl_server, content, message):
    before = vl_server.rows("SELECT count(*) AS n FROM requests")[0]["n"]
    with pytest.raises(openai.BadRequestError, match=message):
        vl_server.client().chat.completions.create(model="tiny-vl", max_tokens=2,
                                                   messages=[{"role": "user", "content": content}])
    assert vl_server.rows("SELECT count(*) AS n FROM requests")[0]["n"] == before


def test_the_served_run_with_images_replays_decision_and_token_identical(vl_server, tmp_path):
    """Last in this module: the server stops, its run (images, hits, rejected bad images) is exported
    and replayed from the bundle, the images found by content hash inside it."""
    import zipfile

    from engine.replay.compare import compare
    from engine.replay.rerun import load_input, replay_run
    from telemetry.bundle_export import export_bundle

    status, stderr = stop(vl_server.proc)
    assert status == 0, stderr
    bundle = export_bundle(vl_server.db, tmp_path / "bundle.zip").path
    with zipfile.ZipFile(bundle) as archive:
        images = sorted(n for n in archive.namelist() if n.startswith("images/"))
    assert len(images) == 2   # the two distinct images of the first test, once each
    recorded, _ = load_input(str(bundle))
    assert sorted(recorded.images) == [n[len("images/"):] for n in images]
    report = compare(recorded, replay_run(recorded, model="tiny-vl"))
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"]
