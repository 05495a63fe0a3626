"""What the API tests share: the server handle, its settings and a free loopback port."""
from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
