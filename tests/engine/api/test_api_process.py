"""The API frontend runs in its own process: a dead peer never hangs or crashes the other side.

Real ``python -m engine serve`` subprocesses, each side killed with SIGKILL:
- frontend killed: its API requests end ``cancelled`` with the pools freed, the workload keeps
  being served, and a new frontend answers on the same port;
- engine killed: an open stream ends with an error event and the frontend exits.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from api_server_helpers import started_server
from serve_process import query, start_serve, stop, wait_for

LONG_STREAM = {"model": "tiny", "prompt": "A long story:", "max_tokens": 900, "min_tokens": 900,
               "temperature": 0, "stream": True}


def frontend_pid(engine: subprocess.Popen) -> int | None:
    """The engine's child running ``engine.api.frontend`` (None when it has none now)."""
    children = []
    for task in Path(f"/proc/{engine.pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for pid in children:
        try:
            if b"engine.api.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        except FileNotFoundError:
            continue
    return None


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_api(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A served API (``extra`` may name another workload: the last --workload wins)."""
    server = started_server(tmp_path, "--ssm-slots", "4", "--kv-blocks", "256", *extra)
    return server.proc, server.url


def test_frontend_process_has_no_torch_and_a_killed_one_is_replaced(tmp_path):
    engine, url = start_api(tmp_path, "--workload", "synthetic", "--rate", "2")
    db = tmp_path / "telemetry.db"
    try:
        old = frontend_pid(engine)
        assert old is not None
        assert "libtorch" not in Path(f"/proc/{old}/maps").read_text()   # starts light: no torch
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG_STREAM, timeout=30) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            os.kill(old, signal.SIGKILL)
            killed = time.monotonic()
            try:                         # the stream ends (the socket closes with the process)
                for _ in lines:
                    pass
            except httpx.HTTPError:
                pass
        assert time.monotonic() - killed < 5
        row = wait_for(lambda: query(db, "SELECT * FROM requests WHERE source = 'api' AND status = 'cancelled'"),
                       "the API request cancelled", engine, timeout_s=10)[0]
        assert "frontend" in row["error"] and row["output_len"] < 900
        finished_before = len(query(db, "SELECT 1 FROM requests WHERE source = 'workload' AND status = 'finished'"))
        wait_for(lambda: len(query(db, "SELECT 1 FROM requests WHERE source = 'workload' AND status = 'finished'"))
                 > finished_before + 1, "the workload served on", engine, timeout_s=30)
        new = wait_for(lambda: (pid := frontend_pid(engine)) not in (None, old) and pid, "a new frontend", engine)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=5, timeout=30)
        reply = client.completions.create(model="tiny", prompt="again", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4 and is_alive(new)
        log = (tmp_path / "engine.log").read_text()
        assert "the API frontend process exited; cancelling its 1 requests" in log
        assert "restarting the API frontend" in log
    finally:
        status, stderr = stop(engine)
    assert status == 0, stderr


def test_killed_engine_ends_open_streams_and_the_frontend_exits(tmp_path):
    engine, url = start_api(tmp_path, "--workload", "none")
    pid = frontend_pid(engine)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG_STREAM, timeout=30) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            engine.kill()
            killed = time.monotonic()
            rest = [line for line in lines if line]
        assert time.monotonic() - killed < 5
        assert any('"engine_gone"' in line or "engine process is gone" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        wait_for(lambda: not is_alive(pid), "the frontend to exit", timeout_s=10)
    finally:
        engine.kill()
        engine.wait()
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_thread_mode_serves_the_same_api(tmp_path):
    engine, url = start_api(tmp_path, "--workload", "none", "--no-api-process")
    try:
        assert frontend_pid(engine) is None
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model="tiny", prompt=[40, 41, 42], max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 5
        assert "frontend thread" in (tmp_path / "engine.log").read_text()
    finally:
        status, stderr = stop(engine)
    assert status == 0, stderr


def test_frontend_modules_import_without_torch():
    code = ("import sys, engine.api.frontend, engine.grammar.compiler; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3]).returncode == 0


def test_a_port_in_use_fails_the_command_at_once(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = start_serve(tmp_path, "--workload", "none", "--api-port", str(port))
        status = engine.wait(timeout=120)
    stderr = (tmp_path / "serve.stderr").read_text()
    assert status == 2 and f"could not listen on 127.0.0.1:{port}" in stderr, stderr[-2000:]
