"""Start the API beside the serve loop: engine facts for the handlers, the bridge, metrics, uvicorn."""
from __future__ import annotations

import argparse
import itertools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.api.bridge import EngineBridge
from engine.api.chat_template import ChatTemplate
from engine.api.metrics import EngineMetrics
from engine.api.parse import EngineInfo
from engine.api.server import APIServer, build_app
from telemetry import events as ev
from telemetry.cli_args import bounded_int

log = logging.getLogger("chunkscope.api")
DEFAULT_MAX_WAITING = 256
# The tick loop releases the GIL at every torch op; while the HTTP thread holds it, the loop
# waits up to the switch interval (5 ms by default) per op. A short interval bounds that stall.
GIL_SWITCH_INTERVAL_S = 0.0002
FIRST_TOKEN_EVENT = "first_token"   # the RequestEvent kind engine/scheduler/outputs.append_token emits


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-port", type=bounded_int(0, 65535), default=None,
                   help="serve the OpenAI-compatible API on this port (0: any free port; default: no API)")
    p.add_argument("--api-host", default="127.0.0.1",
                   help="address the API binds (default 127.0.0.1: this machine only)")
    p.add_argument("--max-waiting", type=bounded_int(1, 1_000_000), default=DEFAULT_MAX_WAITING,
                   help="API requests beyond this many waiting get 429 with Retry-After")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API (default: none)")


@dataclass
class API:
    bridge: EngineBridge
    metrics: EngineMetrics
    server: APIServer
    info: EngineInfo
    _ids: itertools.count = field(default_factory=itertools.count)

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
        """A tick boundary: new requests and cancellations reach the scheduler."""
        self.bridge.drain(sched, self.new_request_id)

    def after_tick(self, sched) -> None:
        """Tokens and ends go out; the gauges show the pools now (also right after a cancel)."""
        self.bridge.publish(sched)
        bm, pool = sched.runner.block_manager, sched.runner.ssm_pool
        self.metrics.set_state(num_running=len(sched.active) + int(sched.prefilling is not None),
                               num_waiting=len(sched.waiting), kv_blocks_used=bm.num_used,
                               kv_blocks_total=bm.num_usable, ssm_slots_used=pool.num_used)


def start_api(args: argparse.Namespace, setup, dropped) -> API | None:
    """The running API, or None when ``--api-port`` was not given."""
    if args.api_port is None:
        return None
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if setup.tokenizer is None:
        raise ValueError(f"--api-port: the checkpoint {setup.checkpoint_dir} has no tokenizer.json to read text with")
    model, bm = setup.model, setup.runner.block_manager
    template = ChatTemplate.for_checkpoint(setup.checkpoint_dir)
    info = EngineInfo(model_name=setup.model_name, vocab_size=setup.runner.vocab_size,
                      max_context=setup.scheduler.max_context, num_kv_blocks=bm.num_blocks,
                      block_size=bm.block_size, tokenizer=setup.tokenizer, chat_template=template,
                      has_tool_call_token=model.tool_call_start_id is not None,
                      eos_ids=frozenset(setup.scheduler.eos_ids), grammars=setup.scheduler.grammars,
                      tool_call_start_id=model.tool_call_start_id, tool_call_end_id=model.tool_call_end_id)
    bridge = EngineBridge(max_waiting=args.max_waiting)
    metrics = EngineMetrics(setup.model_name, dropped)
    server = APIServer(build_app(info, bridge, metrics, args.api_key), args.api_host, args.api_port)
    server.start()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    log.info("API listening on %s (chat template: %s)", server.url, template.origin)
    print(f"[engine] OpenAI-compatible API on {server.url}/v1", flush=True)
    return API(bridge, metrics, server, info)
