"""A real ``python -m engine serve --api-port`` subprocess on a free loopback port, shared by the API tests."""
from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from serve_process import query, start_serve, stop, wait_for  # noqa: E402

MAX_WAITING = 3
SSM_SLOTS = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    run_dir: Path
    proc: object

    @property
    def db(self) -> Path:
        return self.run_dir / "telemetry.db"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def rows(self, sql: str, params: tuple = ()) -> list[dict]:
        return query(self.db, sql, params)

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


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
