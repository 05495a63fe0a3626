"""Dashboards people already have: every query of vLLM's example Grafana dashboard (written down in
tests/fixtures/vllm_grafana_queries.txt) returns data against our /metrics, and so do the queries of
our own dashboard (docs/grafana/chunkscope.json), evaluated over two scrapes with traffic between."""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest

from promql import Evaluator, Scrape
from serve_process import wait_for
from test_api_cancel_errors import pools_free

REPO = Path(__file__).resolve().parents[3]
VLLM_QUERIES = [line.strip() for line in (REPO / "tests" / "fixtures" / "vllm_grafana_queries.txt").read_text()
                .splitlines() if line.strip() and not line.startswith("#")]
DASHBOARD = json.loads((REPO / "docs" / "grafana" / "chunkscope.json").read_text())
OUR_QUERIES = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
# Labelled counters that only have series once their event happened (none of this traffic blocks a
# mix, changes a lever or fails a request).
MAY_BE_EMPTY = ("chunkscope:mix_blocked_total", "chunkscope:lever_changes_total", "chunkscope:requests_failed_total")
SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                    "uniqueItems": True, "maxItems": 2}},
          "required": ["tags"], "additionalProperties": False}


def traffic(server) -> None:
    """Requests that move every family: plain, min_tokens, n = 2, a lenient schema, a truncated grammar."""
    url = f"{server.url}/v1"
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    chat = {**base, "messages": [{"role": "user", "content": "Hi"}]}
    for path, body in (("completions", {**base, "prompt": "Grafana " * 6, "min_tokens": 3}),
                       ("completions", {**base, "prompt": "Grafana " * 6, "n": 2, "temperature": 1.0, "seed": 1}),
                       ("chat/completions", {**chat, "max_tokens": 40, "structured_outputs": {"json": SCHEMA}}),
                       ("chat/completions", {**chat, "max_tokens": 2, "response_format": {"type": "json_object"}})):
        response = httpx.post(f"{url}/{path}", json=body, timeout=120)
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def evaluator(api_server):
    wait_for(lambda: pools_free(api_server), "an idle engine")
    before = Scrape.parse(api_server.metrics_text(), time.monotonic())
    traffic(api_server)
    wait_for(lambda: pools_free(api_server), "the traffic to end")
    time.sleep(0.2)
    after = Scrape.parse(api_server.metrics_text(), time.monotonic())
    return Evaluator(before, after, {"model_name": "tiny", "__rate_interval": "1m"})


@pytest.mark.parametrize("query", VLLM_QUERIES)
def test_vllm_dashboard_query_returns_data(evaluator, query):
    result = evaluator.evaluate(query)
    assert result, f"no series for {query}"
    assert all(math.isfinite(v) for v in result.values()), (query, result)


@pytest.mark.parametrize("query", OUR_QUERIES)
def test_our_dashboard_query_returns_data(evaluator, query):
    result = evaluator.evaluate(query)
    if any(name in query for name in MAY_BE_EMPTY):
        return
    assert result and all(math.isfinite(v) for v in result.values()), (query, result)


def test_vllm_families_carry_vllms_labels(api_server):
    scrape = Scrape.parse(api_server.metrics_text(), 0.0)
    vllm = {name: series for name, series in scrape.samples.items() if name.startswith("vllm:")}
    assert len({re.sub(r"_(bucket|sum|count|created|total)$", "", n) for n in vllm}) >= 28
    for name, series in vllm.items():
        wanted = {"engine"} if name == "vllm:cache_config_info" else {"model_name", "engine"}   # vLLM's, too
        for labels in series:
            assert wanted <= dict(labels).keys(), name
    assert dict(next(iter(vllm["vllm:cache_config_info"])))["enable_prefix_caching"] == "True"
