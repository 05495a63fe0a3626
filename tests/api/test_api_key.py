"""``--api-key``: every endpoint but /health needs ``Authorization: Bearer KEY`` (the app in-process)."""
from __future__ import annotations

from starlette.testclient import TestClient

from engine.api.bridge import EngineBridge
from engine.api.chat_template import ChatTemplate
from engine.api.metrics import EngineMetrics
from engine.api.parse import EngineInfo
from engine.api.server import build_app
from engine.model.tiny import ensure_tiny_checkpoint
from engine.model.tokenizer import load_tokenizer


def test_api_key_is_required_except_for_health():
    info = EngineInfo(model_name="tiny", vocab_size=272, max_context=4096, num_kv_blocks=64, block_size=16,
                      tokenizer=load_tokenizer(ensure_tiny_checkpoint()),
                      chat_template=ChatTemplate.for_checkpoint(None),
                      has_tool_call_token=True)
    app = build_app(info, EngineBridge(max_waiting=4), EngineMetrics("tiny"), api_key="s3cret")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            denied = client.get(path)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        denied = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert denied.status_code == 401
        missing = client.get("/v1/nothing", headers={"Authorization": "Bearer s3cret"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
