"""Start the API beside the serve loop: the frontend process, the bridge to it, the metrics."""
from __future__ import annotations

import argparse
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.api.bridge import EngineBridge
from engine.api.frontend_process import FrontendProcess
from engine.api.metrics import EngineMetrics
from engine.api.wire import FrontendConfig, Ready
from telemetry import events as ev
from telemetry.cli_args import bounded_int
from telemetry.manifest import REDACTED   # the marker bundles use for any secret

log = logging.getLogger("chunkscope.api")
DEFAULT_MAX_WAITING = 256
FIRST_TOKEN_EVENT = "first_token"   # the RequestEvent kind engine/scheduler/outputs.append_token emits


API_KEY_ENV = "CHUNKSCOPE_API_KEY"   # the key without putting it on the command line (how the dashboard passes it)


def redacted_command_line(argv: list[str]) -> list[str]:
    """``argv`` with the API key's value replaced: the command line goes into the run's row and its
    bundles, and a bug report must not carry the key. argparse takes any unambiguous prefix
    (``--api-k``, ``--api-ke=K``), so every spelling of the option counts."""
    out, hide_next = [], False
    for word in argv:
        name, eq, _ = word.partition("=")
        is_key_option = len(name) >= len("--api-k") and "--api-key".startswith(name)
        if hide_next:
            out.append(REDACTED)
        elif is_key_option and eq:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(word)
        hide_next = is_key_option and not eq
    return out


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$CHUNKSCOPE_API_KEY``, else None; an empty one is refused (it would serve an
    open API where the user meant a closed one)."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"the API key is empty (--api-key or ${API_KEY_ENV}): give a key, or neither for an open API")
    return key


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-port", type=bounded_int(0, 65535), default=None,
                   help="serve the OpenAI-compatible API on this port (0: any free port; default: no API)")
    p.add_argument("--api-host", default="127.0.0.1",
                   help="address the API binds (default 127.0.0.1: this machine only)")
    p.add_argument("--max-waiting", type=bounded_int(1, 1_000_000), default=DEFAULT_MAX_WAITING,
                   help="API requests beyond this many waiting get 429 with Retry-After")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on the API (default: ${API_KEY_ENV}, else none); "
                        "never recorded: the run's command line shows it as " + REDACTED)
    p.add_argument("--api-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the HTTP frontend in its own process, off the tick loop's GIL (default); "
                        "--no-api-process runs it as a thread of the engine")


@dataclass
class API:
    bridge: EngineBridge
    metrics: EngineMetrics
    frontend: FrontendProcess | None
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def url(self) -> str:
        return self.frontend.url

    def new_request_id(self) -> int:
        """Request ids in arrival order across API and workload requests (serve renumbers the
        workload's while the API runs, so the two never collide)."""
        return next(self._ids)

    def tee(self, emit: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """The scheduler's emit while the API runs: a first token goes to its client the moment it
        is sampled (not after the rest of the tick), /metrics sees every event, then ``emit``."""
        observe, first_token = self.metrics.tee(emit), self.bridge.first_token

        def on_event(event: Any) -> None:
            if type(event) is ev.RequestEvent and event.kind == FIRST_TOKEN_EVENT:
                first_token(event.request_id)
            observe(event)
        return on_event

    def before_tick(self, sched) -> None:
        """A tick boundary: new requests and cancellations reach the scheduler; a dead frontend's
        requests are cancelled and a new frontend started."""
        self.bridge.drain(sched, self.new_request_id)
        if self.bridge.peer_lost and self.frontend is not None:
            if self.bridge.channel is not None and self.bridge.channel.is_stuck:
                self.frontend.kill()
            self.bridge.attach(self.frontend.restart())
        for notice in self.bridge.take_notices():
            if isinstance(notice, Ready):
                self.frontend.on_ready(notice)
                log.info("API frontend listening again on %s", self.url)
            else:
                log.error("the API frontend could not start: %s", notice.message)

    def after_tick(self, sched) -> None:
        """Tokens and ends go out; the gauges show the pools now (also right after a cancel)."""
        self.bridge.publish(sched)
        bm, pool = sched.pools.blocks, sched.pools.ssm
        self.metrics.set_state(num_running=len(sched.active) + int(sched.prefilling is not None),
                               num_waiting=len(sched.waiting), kv_blocks_used=bm.num_used,
                               kv_blocks_total=bm.num_usable, ssm_slots_used=pool.num_used)

    def wait(self, timeout_s: float) -> None:
        self.bridge.wait(timeout_s)

    def close(self, sched) -> None:
        """Shutdown (after ``sched.stop()``): open requests end, then the frontend exits."""
        self.bridge.close(sched)
        if self.frontend is not None:
            self.frontend.stop()


def frontend_config(args: argparse.Namespace, setup) -> FrontendConfig:
    model, bm = setup.model, setup.scheduler.pools.blocks
    return FrontendConfig(model_name=setup.model_name, checkpoint_dir=str(setup.checkpoint_dir),
                          vocab_size=setup.runner.vocab_size, max_context=setup.scheduler.max_context,
                          num_kv_blocks=bm.num_blocks, block_size=bm.block_size,
                          eos_ids=frozenset(setup.scheduler.eos_ids), tool_call_start_id=model.tool_call_start_id,
                          tool_call_end_id=model.tool_call_end_id, think_end_id=getattr(model, "think_end_id", None),
                          eos_token_id=getattr(model, "eos_token_id", None), host=args.api_host, port=args.api_port,
                          api_key=api_key(args), max_waiting=args.max_waiting,
                          images=setup.scheduler.images.policy(setup.tokenizer) if setup.scheduler.images else None)


def start_api(args: argparse.Namespace, setup, dropped) -> API | None:
    """The running API, or None when ``--api-port`` was not given."""
    if args.api_port is None:
        return None
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if setup.tokenizer is None:
        raise ValueError(f"--api-port: the checkpoint {setup.checkpoint_dir} has no tokenizer.json to read text with")
    frontend = FrontendProcess(frontend_config(args, setup), in_process=not args.api_process)
    pools = setup.scheduler.pools
    metrics = EngineMetrics(setup.model_name, dropped, max_model_len=setup.scheduler.max_context, cache_config={
        "block_size": pools.blocks.block_size, "num_gpu_blocks": pools.blocks.num_blocks,
        "num_ssm_slots": pools.ssm.num_slots, "enable_prefix_caching": pools.prefix is not None,
        "cache_dtype": str(setup.runner.dtype)})
    bridge = EngineBridge(frontend.start(), lambda: list(metrics.registry.collect()))
    log.info("API listening on %s (%s, chat template: %s)", frontend.url,
             f"frontend process {frontend.pid}" if args.api_process else "frontend thread", frontend.chat_template)
    print(f"[engine] OpenAI-compatible API on {frontend.url}/v1", flush=True)
    return API(bridge, metrics, frontend)
