"""Client disconnects cancel their request within a second; bad input never reaches the forward."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api_server_helpers import MAX_WAITING, SSM_SLOTS
from serve_process import wait_for

LONG = {"model": "tiny", "prompt": "A long story:", "max_tokens": 900, "min_tokens": 900, "temperature": 0}
CLIENT = """
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
for chunk in client.completions.create(model="tiny", prompt="Tell me everything:", max_tokens=900, stream=True,
                                       temperature=0, extra_body={"min_tokens": 900}):
    print("chunk", flush=True)
"""


def metric_values(server) -> dict[tuple[str, tuple], float]:
    values = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
            values[(sample.name, labels)] = sample.value
    return values


def pools_free(server) -> bool:
    m = metric_values(server)
    return (m[("vllm:num_requests_running", ())] == 0 and m[("vllm:kv_cache_usage_perc", ())] == 0
            and m[("chunkscope:ssm_slots_used", ())] == 0)


def test_killed_streaming_client_cancels_within_a_second(api_server):
    wait_for(lambda: pools_free(api_server), "an idle engine")
    client = subprocess.Popen([sys.executable, "-c", CLIENT, api_server.url], stdout=subprocess.PIPE, text=True)
    for _ in range(3):
        assert client.stdout.readline().startswith("chunk")
    assert not pools_free(api_server)
    client.kill()
    client.wait()
    killed = time.monotonic()
    wait_for(lambda: pools_free(api_server), "the pools freed after the client died", timeout_s=5)
    assert time.monotonic() - killed < 1.0
    row = wait_for(lambda: api_server.rows("SELECT * FROM requests WHERE status = 'cancelled' AND "
                                           "prompt_len = 19 AND error LIKE '%client disconnected%'"),
                   "the cancelled row")[0]
    assert 3 <= row["output_len"] < 900 and row["finish_reason"] == "cancelled"


def test_non_streaming_client_that_leaves_cancels(api_server):
    wait_for(lambda: pools_free(api_server), "an idle engine")
    # 900 tokens take ~1 s on a fast CPU (the cache holds no more): the client leaves after 0.3 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api_server.url}/v1/completions", json={**LONG, "prompt": "Leave early"}, timeout=0.3)
    left = time.monotonic()
    wait_for(lambda: pools_free(api_server), "the pools freed after the client left", timeout_s=5)
    assert time.monotonic() - left < 1.0
    wait_for(lambda: api_server.rows("SELECT 1 FROM requests WHERE status = 'cancelled' AND prompt_len = 11"),
             "the cancelled row")


def forward_counters(server) -> tuple:
    m = metric_values(server)
    chunks = sum(v for (name, _), v in m.items() if name == "chunkscope:chunks_total")
    return chunks, m[("vllm:generation_tokens_total", ())], m[("vllm:prompt_tokens_total", ())]


def post(server, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=10, **kwargs,
                      **({"content": body} if isinstance(body, (bytes, str)) else {"json": body}))


@pytest.mark.parametrize("body, status, param, code", [
    (b'{"model": "tiny", "prompt": "x", ', 400, None, "invalid_json"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "8"}, 400, "max_tokens", "invalid_value"),
    ({"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs", "invalid_value"),
    ({"model": "tiny", "prompt": [1, 99999]}, 400, "prompt", "invalid_value"),
    ({"model": "tiny", "prompt": "x", "stop": 5}, 400, "stop", "invalid_value"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 40000}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2000}, 400, "max_tokens", "kv_cache_exceeded"),
    (b'{"model": "tiny", "prompt": "' + b"x" * (1 << 20) + b'"}', 413, None, "body_too_large"),
])
def test_bad_input_gets_error_object_and_no_forward(api_server, body, status, param, code):
    wait_for(lambda: pools_free(api_server), "an idle engine")
    before, rows_before = forward_counters(api_server), api_server.rows("SELECT count(*) AS n FROM requests")
    response = post(api_server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    time.sleep(0.3)   # a forward, had there been one, would have counted by now
    assert forward_counters(api_server) == before
    assert api_server.rows("SELECT count(*) AS n FROM requests") == rows_before


def test_chat_bad_messages(api_server):
    response = httpx.post(f"{api_server.url}/v1/chat/completions", timeout=10,
                          json={"model": "tiny", "messages": [{"role": "user", "content": 5}]})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages")


def test_queue_full_gets_429_with_retry_after(api_server):
    wait_for(lambda: pools_free(api_server), "an idle engine")
    with httpx.Client(timeout=30) as http:
        streams, statuses, retry_after = [], [], None
        for i in range(SSM_SLOTS + MAX_WAITING + 3):
            request = http.build_request("POST", f"{api_server.url}/v1/completions",
                                         json={**LONG, "prompt": f"queue {i}", "stream": True})
            response = http.send(request, stream=True)
            statuses.append(response.status_code)
            if response.status_code == 429:
                retry_after = response.headers.get("retry-after")
                assert json.loads(response.read())["error"]["type"] == "rate_limit_error"
                response.close()
            else:
                streams.append(response)
            time.sleep(0.05)
        assert 429 in statuses and retry_after == "1", statuses
        assert statuses.count(200) >= MAX_WAITING
        for response in streams:
            response.close()
    wait_for(lambda: pools_free(api_server), "every queued request cancelled", timeout_s=10)
