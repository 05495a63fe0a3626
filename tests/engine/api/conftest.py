"""A real ``python -m engine serve --api-port`` subprocess on a free loopback port, shared by the API tests."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_server_helpers import MAX_WAITING, SSM_SLOTS, Server, free_port  # noqa: E402
from serve_process import start_serve, stop, wait_for  # noqa: E402


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("api-run")
    port = free_port()
    proc = start_serve(run_dir, "--workload", "none", "--api-port", str(port), "--ssm-slots", str(SSM_SLOTS),
                       "--kv-blocks", "64", "--max-waiting", str(MAX_WAITING))
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, "the API's /health", proc)
    yield Server(url, run_dir, proc)
    stop(proc)
