"""The HTTP app: a Starlette app, run by uvicorn in the API frontend process (``frontend.py``).

Handlers validate and map a body (``parse.py``) to one engine request per choice, submit them
through the bridge, then await the request's outbox: a JSON response once every choice has
ended, or server-sent events as tokens arrive (``choices.py`` joins the choices). A client that
goes away (streaming or not) cancels its requests through the bridge; so does the first choice
that fails. A grammar the lenient compile approximated says so in a response header.
"""
from __future__ import annotations

import asyncio
import json
import logging

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.api.choices import Choices
from engine.api.errors import TYPE_AUTH, TYPE_NOT_FOUND, TYPE_RATE, TYPE_SERVER, APIError
from engine.api.frontend_bridge import EngineGone, FrontendBridge, QueueFull, RequestIds
from engine.api.metrics import CONTENT_TYPE
from engine.api.parse import MAX_BODY_BYTES, EngineInfo, EngineRequest, chat_requests, completion_requests, validate
from engine.api.protocol import ChatCompletionRequest, CompletionRequest
from engine.api.sse import EventStream
from engine.api.wire import Ended, Tokens
from telemetry import events as ev

log = logging.getLogger("chunkscope.api")
RETRY_AFTER_S = 1
CLIENT_CLOSED = 499      # nginx's "client closed request": nobody reads it, the log does
GONE = object()          # put in a stream's outbox when its client disconnects
APPROXIMATIONS_HEADER = "x-chunkscope-grammar-approximations"   # schema keywords a lenient grammar ignored
REQUEST_IDS_HEADER = "x-chunkscope-request-ids"   # the engine's request id of each choice ("17, 18")
# json.dumps(chunk, ensure_ascii=False) builds an encoder per call; one encoder for every chunk
_encode = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode
_END_STATUS = {ev.REQ_ERROR: (500, TYPE_SERVER), ev.REQ_PREEMPTED: (503, TYPE_SERVER),
               ev.REQ_REJECTED: (400, "invalid_request_error"), ev.REQ_CANCELLED: (503, TYPE_SERVER)}


def build_app(info: EngineInfo, bridge: FrontendBridge, api_key: str | None = None) -> Starlette:
    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {declared} bytes, more than {MAX_BODY_BYTES}", code="body_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
        return bytes(body)

    def check_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", type=TYPE_AUTH,
                           code="invalid_api_key")

    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": info.model_name, "object": "model", "created": 0, "owned_by": "chunkscope",
             "max_model_len": info.max_context}]})

    async def metrics_route(request: Request) -> Response:
        check_key(request)
        try:
            families = await bridge.metrics_families()
        except (EngineGone, asyncio.TimeoutError) as exc:
            raise APIError(503, f"the engine did not answer: {exc or 'timeout'}", type=TYPE_SERVER) from None
        return Response(generate_latest(_Families(families)), media_type=CONTENT_TYPE)

    async def completions(request: Request) -> Response:
        check_key(request)
        engine_requests = completion_requests(info, validate(CompletionRequest, await read_body(request)))
        return await _serve(request, engine_requests, Choices(info, engine_requests, chat=False))

    async def chat(request: Request) -> Response:
        check_key(request)
        engine_requests = chat_requests(info, validate(ChatCompletionRequest, await read_body(request)))
        return await _serve(request, engine_requests, Choices(info, engine_requests, chat=True))

    async def _serve(request: Request, engine_requests: list[EngineRequest], choices: Choices) -> Response:
        if len(engine_requests) > bridge.max_waiting:
            raise APIError(400, f"n: {len(engine_requests)} choices in one request, more than the server queues "
                                f"(--max-waiting {bridge.max_waiting})", param="n", code="too_many_choices")
        try:
            handles, outbox, ids = bridge.submit([(r.prompt_tokens, r.sampling, r.features, r.grammar, r.images)
                                                  for r in engine_requests])
        except QueueFull as exc:
            raise APIError(429, str(exc), type=TYPE_RATE, code="too_many_waiting",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineGone as exc:
            raise APIError(503, str(exc), type=TYPE_SERVER, code="engine_gone") from None
        headers = {APPROXIMATIONS_HEADER: ", ".join(choices.approximations)} if choices.approximations else {}
        first = engine_requests[0]
        if first.stream:
            # Headers go first: wait for the engine to take the requests (its next tick boundary,
            # before any token) so they can carry the request ids.
            if not await _ids_known(request, ids):
                bridge.cancel(handles)
                return Response(status_code=CLIENT_CLOSED)
            choices.name_request(ids.ids[0])
            headers[REQUEST_IDS_HEADER] = ids.header()
            return EventStream(_events(handles, outbox, choices, first.include_usage),
                               on_gone=lambda: outbox.put_nowait(GONE), headers=headers)
        return await _whole(request, handles, outbox, choices, headers, ids)

    async def _whole(request: Request, handles: list[int], outbox: asyncio.Queue, choices: Choices,
                     headers: dict, ids: RequestIds) -> Response:
        disconnect = asyncio.ensure_future(_client_gone(request))
        try:
            while not choices.is_over:
                get = asyncio.ensure_future(outbox.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    bridge.cancel(handles)
                    return Response(status_code=CLIENT_CLOSED)
                choices.keep(*get.result())
            if ids.header():         # every id is known by now: the engine sent them before any end
                choices.name_request(ids.ids[0])
                headers = {**headers, REQUEST_IDS_HEADER: ids.header()}
            if choices.failed is not None:
                bridge.cancel(handles)   # the choices still running are of no use now
                response = _ended_error(choices.failed).response()
                response.headers.update(headers)
                return response
            return JSONResponse(choices.response(), headers=headers)
        finally:
            disconnect.cancel()

    async def _events(handles: list[int], outbox: asyncio.Queue, choices: Choices, include_usage: bool):
        try:
            while not choices.is_over:
                item = _merged(await outbox.get(), outbox)
                if item is GONE:
                    break
                chunks = choices.on_item(*item)
                if choices.failed is not None:
                    chunks = [_ended_error(choices.failed).body()]
                elif choices.is_over and include_usage:
                    chunks.append(choices.usage_chunk())
                # One event per chunk, one write for the lot (the last one ends with [DONE]).
                events = "".join(f"data: {_encode(chunk)}\n\n" for chunk in chunks)
                if choices.is_over:
                    events += "data: [DONE]\n\n"
                if events:
                    yield events.encode()
        finally:
            if choices.num_open:   # the client went away, a send failed or a choice failed: stop the rest
                bridge.cancel(handles)

    async def on_api_error(_request: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_http_error(_request: Request, exc: HTTPException) -> Response:
        kind = TYPE_NOT_FOUND if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    async def on_error(_request: Request, exc: Exception) -> Response:
        log.exception("API handler failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type=TYPE_SERVER).response()

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics_route),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                        Exception: on_error})


async def _ids_known(request: Request, ids: RequestIds) -> bool:
    """Wait until the engine has named the requests (or went away); False if the client left first."""
    if ids.known.is_set():
        return True
    known, gone = asyncio.ensure_future(ids.known.wait()), asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({known, gone}, return_when=asyncio.FIRST_COMPLETED)
        return known in done
    finally:
        known.cancel()
        gone.cancel()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (its body has been read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _merged(item, queue: asyncio.Queue):
    """``item`` (index, Tokens) joined with the same choice's token batches queued right behind it: a
    client that fell behind gets one larger event instead of many small ones (an end stays queued)."""
    if item is GONE:
        return item
    index, tokens = item
    while isinstance(tokens, Tokens) and not queue.empty():
        after = queue._queue[0]
        if after is GONE or after[0] != index or not isinstance(after[1], Tokens):
            break
        more = queue.get_nowait()[1]
        tokens = Tokens(tokens.token_ids + more.token_ids, tokens.logprobs + more.logprobs,
                        tokens.prompt_logprobs if tokens.prompt_logprobs is not None else more.prompt_logprobs)
    return index, tokens


def _ended_error(item: Ended) -> APIError:
    status, kind = _END_STATUS.get(item.status, (500, TYPE_SERVER))
    return APIError(status, f"request {item.status}: {item.error}", type=kind, code=item.status)


class _Families:
    """The engine's metric families as a collector ``generate_latest`` renders (here, not on the engine)."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)
