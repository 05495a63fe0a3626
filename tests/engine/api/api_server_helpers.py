"""What the API tests share: the server handle, its settings and a free loopback port."""
from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_process import query, start_serve, stop, wait_for  # noqa: E402

MAX_WAITING = 3
SSM_SLOTS = 2


def started_server(run_dir: Path, *args: str, env_extra: dict[str, str] | None = None) -> Server:
    """``serve --workload none --api-port P *args`` on a free port, once its /health answers (a
    ``--workload`` in ``args`` wins: argparse keeps the last); ``env_extra``: lever variables."""
    port = free_port()
    proc = start_serve(run_dir, "--workload", "none", "--api-port", str(port), *args, env_extra=env_extra)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, "the API's /health", proc)
    return Server(url, run_dir, proc)


@contextmanager
def serving(run_dir: Path, *args: str) -> Iterator[Server]:
    """``started_server(run_dir, *args)`` for a fixture's lifetime, stopped (SIGTERM, drained) after."""
    server = started_server(run_dir, *args)
    try:
        yield server
    finally:
        stop(server.proc)


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
