"""The engine's end of the socket to the API frontend: never blocks the tick loop.

Sends are buffered and written as far as the socket takes them (the rest goes with the next
send or ``wait``); receives read whatever has arrived. A frontend that stops reading lets
the buffer grow: past ``MAX_PENDING_BYTES`` it counts as hung (``is_stuck``) and the
supervisor kills it, so a stalled peer costs the engine memory for a moment, never a hang.
"""
from __future__ import annotations

import select
import socket
from typing import Any

from engine.api.wire import PeerGone, frame, unframe

MAX_PENDING_BYTES = 64 << 20
READ_BYTES = 1 << 20


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._in = bytearray()
        self._out = bytearray()
        self.is_closed = False

    def send(self, message: Any) -> None:
        if self.is_closed:
            return
        self._out += frame(message)
        self.flush()

    def flush(self) -> None:
        while self._out and not self.is_closed:
            try:
                sent = self._sock.send(self._out)
            except BlockingIOError:
                return
            except OSError:          # the peer is gone (EPIPE / ECONNRESET)
                self._lost()
                return
            del self._out[:sent]

    @property
    def is_stuck(self) -> bool:
        return len(self._out) > MAX_PENDING_BYTES

    def receive(self) -> list[Any]:
        """Every whole message that has arrived; sets ``is_closed`` once the peer has gone."""
        while not self.is_closed:
            try:
                data = self._sock.recv(READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                self._lost()
                break
            if not data:
                self._lost()
                break
            self._in += data
        try:
            return unframe(self._in)
        except PeerGone:
            self._lost()
            return []

    def wait(self, timeout_s: float) -> None:
        """Until a message arrives (or the peer goes, or the timeout); pending sends go out meanwhile."""
        if self.is_closed:
            return
        try:
            select.select([self._sock], [self._sock] if self._out else [], [], timeout_s)
        except (OSError, ValueError):
            self._lost()
            return
        self.flush()

    def _lost(self) -> None:
        self.is_closed = True
        self._out.clear()

    def close(self) -> None:
        self.flush()
        self._lost()
        try:
            self._sock.close()
        except OSError:
            pass
