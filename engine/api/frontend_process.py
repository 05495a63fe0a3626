"""Start, watch and restart the API frontend (engine side).

The frontend runs as its own process (``python -m engine.api.frontend``), so the ~100 us of
Python each streamed token costs there never holds the GIL the tick loop needs. With
``--no-api-process`` it runs as a thread of the engine instead (one process, as before;
``bench/api.py`` compares the two).

The first start waits until the frontend listens (a port in use fails the command at once).
When it dies later, the engine restarts it at most ``MAX_RESTARTS`` times, without waiting:
the workload keeps running meanwhile, and after the last restart the engine serves on
without an API and says so.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from engine.api.channel import Channel
from engine.api.wire import Failed, FrontendConfig, Ready

log = logging.getLogger("chunkscope.api")
MAX_RESTARTS = 3
START_TIMEOUT_S = 120.0    # the first start: imports on a loaded machine (no torch: usually ~2 s)
STOP_TIMEOUT_S = 5.0
REPO = Path(__file__).resolve().parents[2]


class FrontendProcess:
    def __init__(self, config: FrontendConfig, *, in_process: bool = False) -> None:
        self.config = config
        self.in_process = in_process
        self.num_restarts = 0
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self.channel: Channel | None = None
        self.chat_template = ""

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Channel:
        """Start the frontend and wait until it listens; ValueError when it cannot."""
        channel = self._spawn()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for message in channel.receive():
                if isinstance(message, Ready):
                    self.on_ready(message)
                    return channel
                if isinstance(message, Failed):
                    self.stop()
                    raise ValueError(message.message)
            if channel.is_closed or time.monotonic() > deadline:
                self.stop()
                raise ValueError("--api-port: the API frontend did not start (see the log above)")
            channel.wait(0.05)

    def on_ready(self, ready: Ready) -> None:
        """A later start keeps the port the first one bound (``--api-port 0`` picked it)."""
        if self.config.port == 0:
            self.config = replace(self.config, port=ready.port)
        self.chat_template = ready.chat_template

    def restart(self) -> Channel | None:
        """A new frontend after the old one died (not waited for); None once the restarts are spent."""
        self._reap()
        if self.num_restarts >= MAX_RESTARTS:
            log.error("the API frontend died %d times; serving on without the API", self.num_restarts + 1)
            return None
        self.num_restarts += 1
        log.warning("restarting the API frontend on %s (restart %d of at most %d)", self.url, self.num_restarts,
                    MAX_RESTARTS)
        return self._spawn()

    def _spawn(self) -> Channel:
        ours, theirs = socket.socketpair()
        if self.in_process:
            from engine.api.frontend import run
            self._thread = threading.Thread(target=_run_quietly, args=(run, theirs), name="chunkscope-api",
                                            daemon=True)
            self._thread.start()
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen([sys.executable, "-m", "engine.api.frontend", "--fd", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), start_new_session=True, env=env, cwd=REPO)
            theirs.close()   # the child holds its end: its death closes the socket for us
        self.channel = Channel(ours)
        self.channel.send(self.config)
        return self.channel

    def kill(self) -> None:
        """A hung frontend (it stopped reading): end it; the restart path takes over."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def _reap(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self._proc is not None:
            self.kill()
            self._proc.wait(timeout=STOP_TIMEOUT_S)
            self._proc = None

    def stop(self) -> None:
        """Shutdown: closing the socket tells the frontend to end its streams and exit."""
        if self.channel is not None:
            self.channel.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("the API frontend did not exit within %.0f s; killing it", STOP_TIMEOUT_S)
                self._proc.kill()
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            self._proc = None
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)


def _run_quietly(run, sock) -> None:
    try:
        run(sock)
    except Exception:   # noqa: BLE001 (a dead frontend thread closes its socket; the engine restarts it)
        log.exception("the API frontend thread failed")
    finally:
        sock.close()
