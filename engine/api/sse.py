"""A server-sent-event response as a bare ASGI app: one ``send`` per event and nothing else.

Starlette's ``StreamingResponse`` runs every stream in an anyio task group (a cancel scope
around each chunk) to notice a client that goes away. Here one watcher task waits for the
disconnect and tells the stream through ``on_gone``; the events themselves go straight to
``send``. With 64 streams, per-token overhead on the HTTP thread is time the tick loop waits
for the GIL.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStream:
    """Sends each bytes item of ``events`` as it comes; calls ``on_gone`` if the client disconnects first."""

    def __init__(self, events: AsyncIterator[bytes], on_gone: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        self._events = events
        self._on_gone = on_gone
        self._headers = HEADERS + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            async with aclosing(self._events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()

    async def _watch(self, receive) -> None:
        """The request body has been read, so the next message can only be the disconnect."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self._on_gone()
