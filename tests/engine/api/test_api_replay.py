"""A run with API traffic exports a bundle whose workload.jsonl carries each request's features,
and replays tick for tick with the same tokens (thinking, forced tool call, stop strings, logprobs)."""
from __future__ import annotations

import json
import threading
import zipfile

import httpx
import openai

from api_server_helpers import free_port, started_server
from engine.replay.rerun import load_input, replay_run
from engine.replay.compare import compare
from serve_process import kill_quietly, start_serve, stop, wait_for
from telemetry.bundle_export import export_bundle

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_api_run_bundle_replays_identically(tmp_path):
    port = free_port()
    proc = start_serve(tmp_path, "--workload", "none", "--api-port", str(port), "--ssm-slots", "4", "--kv-blocks", "64")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=60)
        wait_for(lambda: _up(client), "the API", proc)
        chat = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6)
        calls = [
            lambda: client.chat.completions.create(
                **chat, extra_body={"chat_template_kwargs": {"enable_thinking": True}}),
            lambda: client.chat.completions.create(**chat, tools=TOOLS, tool_choice="required", temperature=0),
            lambda: client.completions.create(model="tiny", prompt="stop here", max_tokens=20, stop=["e", "a"],
                                              temperature=0.7, seed=3, logprobs=2),
            lambda: client.completions.create(model="tiny", prompt="x" * 300, max_tokens=8, temperature=0),
            lambda: _leave_early(port),
        ]
        threads = [threading.Thread(target=call) for call in calls]   # concurrent: mixed chunks, batches
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        status, stderr = stop(proc)
    finally:
        kill_quietly(proc)
    assert status == 0, stderr
    bundle = export_bundle(tmp_path / "telemetry.db", tmp_path / "bundle.zip").path
    with zipfile.ZipFile(bundle) as archive:
        name = next(n for n in archive.namelist() if n.endswith("workload.jsonl"))
        lines = [json.loads(line) for line in archive.read(name).decode().splitlines()]
        summary = archive.read(next(n for n in archive.namelist() if n.endswith("summary.md"))).decode()
    assert "## Requests by source" in summary and "| api | finished | 4 |" in summary
    assert "| api | cancelled | 1 |" in summary
    features = [line["features"] for line in lines]
    assert len(lines) == 5 and all(f["source"] == "api" for f in features)
    assert any(f["enable_thinking"] for f in features) and any(f["require_tool_call"] for f in features)
    assert any(f["stop_strings"] == ["e", "a"] and f["logprobs"] == 2 for f in features)
    recorded, _ = load_input(str(bundle))
    cancelled = [r for r in recorded.requests if r.status == "cancelled"]
    assert len(cancelled) == 1 and 3 <= len(cancelled[0].output_tokens) < 200
    report = compare(recorded, replay_run(recorded, model="tiny"))
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"]


def _leave_early(port: int) -> None:
    """A streaming client that reads three events and disconnects: cancelled, and replayed as such."""
    body = {"model": "tiny", "prompt": "leaving", "max_tokens": 200, "min_tokens": 200, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break


def _up(client) -> bool:
    try:
        return bool(client.models.list().data)
    except openai.APIError:
        return False


def test_issue_31_features_replay_identically(tmp_path):
    """n siblings (tail snapshot, prefix hits), logit_bias and penalties, echo's prompt logprobs and a
    lenient schema travel with their requests: the bundle replays decision and token identical."""
    server = started_server(tmp_path, "--ssm-slots", "4", "--kv-blocks", "64")
    proc, url = server.proc, f"{server.url}/v1"
    prompt = list(b"Replay the siblings of this prompt, please.")   # 42 tokens: tail boundary 32
    schema = {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True, "maxItems": 3}
    bodies = [("completions", {"prompt": prompt, "n": 3, "max_tokens": 6, "temperature": 0.9, "seed": 4,
                               "presence_penalty": 1.5, "logit_bias": {"90": 5}}),
              ("completions", {"prompt": "echo me", "echo": True, "logprobs": 2, "max_tokens": 3,
                               "frequency_penalty": 2.0, "temperature": 0}),
              ("chat/completions", {"messages": [{"role": "user", "content": "nums"}], "max_tokens": 12,
                                    "temperature": 0, "structured_outputs": {"json": schema}})]
    try:
        for path, body in bodies:
            response = httpx.post(f"{url}/{path}", json={"model": "tiny", **body}, timeout=60)
            assert response.status_code == 200, response.text
        status, stderr = stop(proc)
    finally:
        kill_quietly(proc)
    assert status == 0, stderr
    bundle = export_bundle(tmp_path / "telemetry.db", tmp_path / "bundle.zip").path
    recorded, _ = load_input(str(bundle))
    assert [r.prefix_hit_tokens for r in recorded.requests[:3]] == [0, 32, 32]
    report = compare(recorded, replay_run(recorded, model="tiny"))
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"]

