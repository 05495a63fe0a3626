"""Rank 0's side of every forward: broadcast first, gather every rank's timings after.

Attached to the MoE model (``Qwen35MoeForCausalLM.leader``) so every caller of the model (the
runner's prefill / decode / mixed forwards, speculative verification) broadcasts without
knowing about ranks. The per-rank timings become one ``ep_forward`` event per rank per forward
(only rank 0 writes the store), drawn as per-rank lanes on the Live timeline.
"""
from __future__ import annotations

import subprocess
import time
from typing import Callable

import torch
import torch.distributed as dist

from engine.cache.ssm_pool import SSMPool
from engine.distributed import control, vision_sync
from engine.distributed.group import EPGroup, collective
from engine.model.batch import PackedBatch
from engine.model.errors import RankFailure
from telemetry import events as ev

# Timing fields each rank reports after a forward (ns).
TIMING_FIELDS = ("broadcast_ns", "expert_ns", "exchange_ns", "forward_ns")


def gather_timings(group: EPGroup, values: list[float], device: torch.device) -> list[list[float]]:
    """All ranks' TIMING_FIELDS for the forward just run (a collective every rank joins)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(group.size)]
    with collective(group, "timing all-gather"):
        dist.all_gather(every, mine)
    return [t.tolist() for t in every]


class EPLeader:
    def __init__(self, group: EPGroup, device: torch.device, block_size: int,
                 children: list[subprocess.Popen] | None = None):
        self.group, self.device, self.block_size = group, device, block_size
        self.children = children or []  # ranks this process spawned (none under torchrun)
        self.keepalive_s = group.timeout_s / 4
        self.last_sent = time.monotonic()
        self.last_broadcast_ns: int | None = None
        self.last_vision_sync_ns: int | None = None   # the image rows' broadcast (None: the forward had none)
        self.emit: Callable | None = None
        self.now_ns: Callable[[], int] = time.monotonic_ns
        self.tick: Callable[[], int] = lambda: 0
        self.num_forwards = 0

    def attach_telemetry(self, emit: Callable, now_ns: Callable[[], int], tick: Callable[[], int]) -> None:
        self.emit, self.now_ns, self.tick = emit, now_ns, tick

    def check_children(self) -> None:
        """A spawned rank that exited is a failure even before a collective notices it."""
        for rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is not None:
                raise RankFailure(f"expert-parallel rank {rank} (pid {child.pid}) exited with status {code}")

    def before_forward(self, batch: PackedBatch, rows: torch.Tensor | None, pool: SSMPool) -> None:
        self.check_children()
        start = time.perf_counter_ns()
        control.send_forward(self.group, batch, rows, pool, self.block_size)
        synced = time.perf_counter_ns()
        self.last_broadcast_ns = synced - start
        self.last_vision_sync_ns = time.perf_counter_ns() - synced if vision_sync.send(self.group, batch) else None
        self.last_sent = time.monotonic()

    def after_forward(self, start_ns: int, expert_ns: int, exchange_ns: int, forward_ns: int) -> None:
        """Gather every rank's timings; one event per rank (``start_ns``: run time of the forward's start)."""
        every = gather_timings(self.group, [self.last_broadcast_ns or 0, expert_ns, exchange_ns, forward_ns],
                               self.device)
        self.num_forwards += 1
        if self.emit is None:
            return
        tick = self.tick()
        for rank, values in enumerate(every):
            detail = {"rank": rank, "start_ns": start_ns, **{k: int(v) for k, v in zip(TIMING_FIELDS, values)}}
            self.emit(ev.GenericEvent(tick=tick, t_ns=start_ns, kind=ev.EVENT_EP_FORWARD, detail=detail))

    def keepalive(self) -> None:
        """While rank 0 idles, tell the other ranks it is alive before their wait times out."""
        if time.monotonic() - self.last_sent < self.keepalive_s:
            return
        self.check_children()
        control.send_control(self.group, control.OP_IDLE, self.device)
        self.last_sent = time.monotonic()

    def stop(self) -> None:
        """Tell the other ranks to exit (a clean end of the run)."""
        control.send_control(self.group, control.OP_STOP, self.device)
