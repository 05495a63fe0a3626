"""The API frontend process: ``python -m engine.api.frontend --fd N``, started by the engine.

Everything HTTP lives here, off the engine's GIL: parsing and validation, the tokenizer and
chat template, the grammar compile check, output parsing, detokenizing, server-sent events,
/metrics rendering and /health. The engine keeps the tick loop, the scheduler, telemetry and
the counters; the two talk over the socket pair on fd N (``wire.py``). Never imports torch,
so it starts in a second or two.

When the engine goes away (its end of the socket closes) every open stream ends with an
error event (a waiting request gets 503) and the process exits. Started in its own session,
a terminal's Ctrl-C reaches only the engine, which decides when the frontend stops.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from engine.api.chat_template import ChatTemplate
from engine.api.frontend_bridge import FrontendBridge
from engine.api.parse import EngineInfo
from engine.api.server import build_app
from engine.api.wire import Failed, FrontendConfig, PeerGone, Ready, frame, unframe
from engine.model.tokenizer import load_tokenizer

log = logging.getLogger("chunkscope.api")
READ_BYTES = 1 << 20
STOP_GRACE_S = 2


def engine_info(config: FrontendConfig) -> EngineInfo:
    directory = Path(config.checkpoint_dir)
    tokenizer = load_tokenizer(directory)
    if tokenizer is None:
        raise ValueError(f"--api-port: the checkpoint {directory} has no tokenizer.json to read text with")
    from engine.grammar.compiler import GrammarCompiler, build_ll_tokenizer
    eos = {config.eos_token_id} if config.eos_token_id is not None else set()
    grammars = GrammarCompiler(build_ll_tokenizer(tokenizer.inner, config.vocab_size, eos),
                               think_end_id=config.think_end_id)
    return EngineInfo(model_name=config.model_name, vocab_size=config.vocab_size, max_context=config.max_context,
                      num_kv_blocks=config.num_kv_blocks, block_size=config.block_size, tokenizer=tokenizer,
                      chat_template=ChatTemplate.for_checkpoint(directory),
                      has_tool_call_token=config.tool_call_start_id is not None, eos_ids=config.eos_ids,
                      grammars=grammars, tool_call_start_id=config.tool_call_start_id,
                      tool_call_end_id=config.tool_call_end_id, images=config.images)


def read_config(sock: socket.socket) -> FrontendConfig:
    """The engine's first message (blocking: nothing else can happen before it)."""
    buffer = bytearray()
    while True:
        messages = unframe(buffer)
        if messages:
            return messages[0]
        data = sock.recv(READ_BYTES)
        if not data:
            raise PeerGone("the engine closed the socket before sending the configuration")
        buffer += data


async def serve(sock: socket.socket, config: FrontendConfig) -> None:
    """Serve HTTP until the engine's end of ``sock`` closes."""
    loop = asyncio.get_running_loop()
    try:
        info = await loop.run_in_executor(None, engine_info, config)
    except Exception as exc:   # noqa: BLE001 (any failure is reported to the engine, which reports it)
        sock.sendall(frame(Failed(f"{type(exc).__name__}: {exc}")))
        return
    bridge = FrontendBridge(max_waiting=config.max_waiting)
    reader, writer = await asyncio.open_connection(sock=sock)
    bridge.connect(writer.write)
    server = uvicorn.Server(uvicorn.Config(build_app(info, bridge, config.api_key), host=config.host,
                                           port=config.port, log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=STOP_GRACE_S))
    serving = asyncio.ensure_future(_serve_http(server))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if not server.started:
        writer.write(frame(Failed(f"--api-port: the API could not listen on {config.host}:{config.port} "
                                  "(in use, or not an address of this machine?)")))
        await writer.drain()
        return
    port = next((s.getsockname()[1] for srv in server.servers for s in srv.sockets), config.port)
    writer.write(frame(Ready(port, info.chat_template.origin)))
    reading = asyncio.ensure_future(_read_engine(reader, bridge))
    # Until the engine goes, or uvicorn stops on its own (a signal): either way this process ends,
    # and the engine, seeing the socket close, cancels what it held for us and starts a new one.
    await asyncio.wait({reading, serving}, return_when=asyncio.FIRST_COMPLETED)
    bridge.on_engine_gone()
    server.should_exit = True
    await serving
    reading.cancel()
    writer.close()


async def _serve_http(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit:   # uvicorn exits when it cannot bind: ``serve`` reports that to the engine
        pass


async def _read_engine(reader: asyncio.StreamReader, bridge: FrontendBridge) -> None:
    buffer = bytearray()
    while True:
        data = await reader.read(READ_BYTES)
        if not data:
            return
        buffer += data
        try:
            batches = unframe(buffer)
        except PeerGone:
            log.error("a broken message from the engine; stopping")
            return
        for batch in batches:
            bridge.on_batch(batch)


def event_loop_factory():
    """uvloop when installed (what uvicorn would pick): cheaper reads and writes per stream."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(sock: socket.socket) -> None:
    """Read the configuration from ``sock``, then serve (in this thread) until the engine goes."""
    config = read_config(sock)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(sock, config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.api.frontend", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="this end of the socket pair to the engine")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s chunkscope.api.frontend: %(message)s")
    sock = socket.socket(fileno=args.fd)
    try:
        run(sock)
    except PeerGone:
        return 0
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
