"""A real ``python -m engine serve --api-port`` subprocess on a free loopback port, shared by the API tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_server_helpers import MAX_WAITING, SSM_SLOTS, started_server  # noqa: E402
from serve_process import stop  # noqa: E402


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    server = started_server(tmp_path_factory.mktemp("api-run"), "--ssm-slots", str(SSM_SLOTS), "--kv-blocks", "64",
                            "--max-waiting", str(MAX_WAITING))
    yield server
    stop(server.proc)
