"""``--api-key``: every endpoint but /health needs ``Authorization: Bearer KEY`` (the app in-process,
with an engine stand-in that answers /metrics queries from a real, empty ``EngineMetrics``)."""
from __future__ import annotations

import asyncio

from starlette.testclient import TestClient

from engine.api.chat_template import ChatTemplate
from engine.api.frontend_bridge import FrontendBridge
from engine.api.metrics import EngineMetrics
from engine.api.parse import EngineInfo
from engine.api.server import build_app
from engine.api.wire import Batch, MetricsQuery, unframe
from engine.model.tiny import ensure_tiny_checkpoint
from engine.model.tokenizer import load_tokenizer


def test_api_key_is_required_except_for_health():
    info = EngineInfo(model_name="tiny", vocab_size=272, max_context=4096, num_kv_blocks=64, block_size=16,
                      tokenizer=load_tokenizer(ensure_tiny_checkpoint()),
                      chat_template=ChatTemplate.for_checkpoint(None),
                      has_tool_call_token=True)
    bridge, metrics = FrontendBridge(max_waiting=4), EngineMetrics("tiny")

    def engine(data: bytes) -> None:   # what the engine's publish does with a /metrics query
        queries = [op.query_id for ops in unframe(bytearray(data)) for op in ops if isinstance(op, MetricsQuery)]
        asyncio.get_running_loop().call_soon(bridge.on_batch, Batch(metrics={
            query_id: list(metrics.registry.collect()) for query_id in queries}))

    bridge.connect(engine)
    app = build_app(info, bridge, api_key="s3cret")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            denied = client.get(path)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            allowed = client.get(path, headers={"Authorization": "Bearer s3cret"})
            assert allowed.status_code == 200
        assert "vllm:num_requests_running" in allowed.text
        denied = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert denied.status_code == 401
        missing = client.get("/v1/nothing", headers={"Authorization": "Bearer s3cret"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
