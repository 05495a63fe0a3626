"""``serve --limit-mm-per-prompt`` (vLLM's spelling): the image count a request may carry, through the
official ``openai`` client on tiny-vl, recorded in the run and honoured by its replay; bad values and
a text-only model are one-line errors."""
from __future__ import annotations

import argparse
import subprocess
import sys

import openai
import pytest

from api_server_helpers import started_server
from serve_process import stop, wait_for
from engine.multimodal.limits import ImageError, ImageLimits, parse_mm_limits
from engine.serve.engine_setup import build_engine
from engine.serve.workload_feed import image_share
from engine.workload.request import WorkloadError
from telemetry.levers import defaults
from test_api_vision import data_url
from tests.engine.model.vision_checkpoints import png_bytes


def images(count: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "see"}] + [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(16, 16, i))}} for i in range(count)]}]


def test_parse_takes_vllms_form_and_names_what_is_wrong():
    assert parse_mm_limits('{"image": 6}') == ImageLimits(max_images=6)
    assert parse_mm_limits("{}") == ImageLimits()
    assert parse_mm_limits('{"image": 0}').max_images == 0
    for text, message in (("image=2", "not a JSON object"), ("[2]", "not a JSON object"),
                          ('{"video": 1}', "only image inputs"), ('{"image": 65}', "integer 0-64"),
                          ('{"image": -1}', "integer 0-64"), ('{"image": "2"}', "integer 0-64"),
                          ('{"image": true}', "integer 0-64"), ("[" * 3000, "too long"),
                          ("[" * 150, "not a JSON object")):
        with pytest.raises(ImageError, match=message) as caught:
            parse_mm_limits(text)
        assert len(str(caught.value)) < 160
    # What a replay reads back from the run's config, checked the same way.
    assert ImageLimits.from_dict(ImageLimits(5).to_dict()) == ImageLimits(5)
    for bad in ([], {"max_images": -1}, {"max_images": "4"}, {"max_bytes": True}):
        with pytest.raises(ImageError, match="image_limits"):
            ImageLimits.from_dict(bad)


@pytest.mark.parametrize("args, message", [
    (["--limit-mm-per-prompt", '{"audio": 1}'], "only image inputs are served, not 'audio'"),
    (["--model", "tiny", "--limit-mm-per-prompt", '{"image": 2}'], "tiny has no vision tower"),
])
def test_a_bad_limit_or_a_text_only_model_is_one_line_and_exit_2(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "engine", "serve", "--run-dir", str(tmp_path), "--requests", "1",
                           *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_no_images_allowed_means_no_workload_images_by_default_and_a_share_is_refused():
    setup = build_engine("tiny-vl", kv_blocks=16, ssm_slots=2, levers=defaults(), image_limits=ImageLimits(0))
    assert setup.engine_config["image_limits"]["max_images"] == 0
    assert image_share(argparse.Namespace(image_share=None), setup) == 0.0
    with pytest.raises(WorkloadError, match="allows no images"):
        image_share(argparse.Namespace(image_share=0.5), setup)


def test_the_limit_is_served_recorded_and_replayed(tmp_path):
    from engine.replay.compare import compare
    from engine.replay.rerun import load_input, replay_run
    from telemetry.bundle_export import export_bundle

    server = started_server(tmp_path / "run", "--model", "tiny-vl", "--kv-blocks", "64",
                            "--limit-mm-per-prompt", '{"image": 5}')
    try:
        client = server.client()
        reply = client.chat.completions.create(model="tiny-vl", messages=images(5), max_tokens=3, temperature=0)
        assert reply.choices[0].message.content is not None
        with pytest.raises(openai.BadRequestError, match="at most 5 images per request"):
            client.chat.completions.create(model="tiny-vl", messages=images(6), max_tokens=3)
        wait_for(lambda: server.rows("SELECT num_images FROM requests WHERE status = 'finished'"), "the request row")
    finally:
        status, stderr = stop(server.proc)
    assert status == 0, stderr
    # The run records the limit; its replay accepts the 5-image request again (the default allows 4).
    bundle = export_bundle(server.db, tmp_path / "bundle.zip").path
    recorded, _ = load_input(str(bundle))
    assert recorded.config["image_limits"]["max_images"] == 5
    report = compare(recorded, replay_run(recorded, model="tiny-vl"))
    assert report["decisions_identical"] and report["tokens_identical"], report["first_divergence"]
