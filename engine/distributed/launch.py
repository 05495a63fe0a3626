"""``--ep N``: start the ranks (spawned here, or already started by ``torchrun``) and bring up rank 0.

Spawned: rank 0 is this process; ranks 1..N-1 are ``python -m engine.distributed.worker``
children on this machine, which the kernel kills if rank 0 dies (PR_SET_PDEATHSIG) and rank 0
kills when the run ends badly. Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
set) every rank runs the same command and ranks > 0 become workers: the same code spans machines.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.distributed.exchange import EXCHANGE_ALL_TO_ALL, EXCHANGES, make_exchange
from engine.distributed.group import DEFAULT_TIMEOUT_S, EPGroup, check_start, init_group, shutdown
from engine.distributed.leader import EPLeader
from engine.distributed.worker import start_settings
from telemetry.cli_args import bounded_float, bounded_int

log = logging.getLogger("chunkscope.ep")
CHILD_EXIT_WAIT_S = 5.0  # how long a stopped rank gets to leave before it is killed


def add_arguments(parser) -> None:
    parser.add_argument("--ep", type=bounded_int(1, 1024), default=1,
                        help="expert-parallel ranks for a MoE checkpoint (default 1); N > 1 spawns N-1 rank "
                             "processes, or joins the group torchrun started")
    parser.add_argument("--ep-timeout", type=bounded_float(0.0, 3600.0, low_open=True), default=DEFAULT_TIMEOUT_S,
                        help=f"seconds a rank may take to answer a collective before the run ends "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--ep-exchange", choices=EXCHANGES, default=EXCHANGE_ALL_TO_ALL,
                        help="how MoE blocks exchange expert rows between ranks (default all_to_all)")


def rank_of(size: int) -> tuple[int, bool]:
    """(this process's rank, whether torchrun started the ranks)."""
    if size < 1:
        raise ValueError(f"--ep must be >= 1, got {size}")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or size == 1:
        return 0, False
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"--ep {size}, but torchrun started WORLD_SIZE={world} ranks")
    return int(os.environ["RANK"]), True


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent (rank 0) dies, whatever killed it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class WorkerArgs:
    model: str
    kv_blocks: int
    ssm_slots: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    threads: int | None
    size: int
    timeout_s: float
    exchange: str

    def argv(self, rank: int) -> list[str]:
        # NCCL needs one GPU per rank: rank r of a CUDA run takes cuda:r on this machine.
        device = f"cuda:{rank}" if self.device.type == "cuda" else str(self.device)
        args = ["--model", self.model, "--kv-blocks", str(self.kv_blocks), "--ssm-slots", str(self.ssm_slots),
                "--block-size", str(self.block_size), "--dtype", str(self.dtype).removeprefix("torch."),
                "--device", device, "--ep", str(self.size), "--ep-timeout", str(self.timeout_s),
                "--ep-exchange", self.exchange]
        return args + (["--threads", str(self.threads)] if self.threads else [])


def spawn_ranks(spec: WorkerArgs) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 on this machine; rank 0 (this process) joins through the same env."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    children = []
    for rank in range(1, spec.size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(spec.size)}
        children.append(subprocess.Popen([sys.executable, "-m", "engine.distributed.worker", *spec.argv(rank)],
                                         env=env, preexec_fn=_die_with_parent))
    return children


@dataclass
class EPRun:
    """Rank 0's handle on the ranks: the leader attached to the model, the children it spawned."""

    group: EPGroup
    leader: EPLeader
    children: list[subprocess.Popen] = field(default_factory=list)

    def describe(self) -> dict:
        return {"ranks": self.group.size, "backend": self.group.backend, "timeout_s": self.group.timeout_s,
                "rank_pids": {str(r): c.pid for r, c in enumerate(self.children, start=1)}}

    def write_pids(self, run_dir: Path) -> None:
        """``ep_ranks.json``: which process is which rank (operators and the failure test read it)."""
        pids = {"0": os.getpid(), **{str(r): c.pid for r, c in enumerate(self.children, start=1)}}
        with contextlib.suppress(OSError):
            (run_dir / "ep_ranks.json").write_text(json.dumps(pids))

    def close(self, failed: bool) -> None:
        """Clean end: stop word, ranks exit; after a failure: kill what is left. Never waits unbounded."""
        if not failed:
            try:
                self.leader.stop()
            except Exception as err:  # a rank already gone: fall through to killing the rest
                log.error("expert-parallel stop failed: %s", err)
                failed = True
        for child in self.children:
            if failed and child.poll() is None:
                child.kill()
            try:
                child.wait(timeout=CHILD_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=CHILD_EXIT_WAIT_S)
        shutdown()


def start_leader(model, runner, spec: WorkerArgs, checkpoint_hash: str,
                 children: list[subprocess.Popen]) -> EPRun:
    """Rank 0: join the group, check every rank loaded the same thing, attach exchange and leader."""
    try:
        group = init_group(0, spec.size, spec.timeout_s, spec.device)
        check_start(group, checkpoint_hash, start_settings(spec.size, spec.kv_blocks, spec.ssm_slots,
                                                           spec.block_size, spec.dtype, spec.exchange,
                                                           model.config.hidden_size), spec.device)
    except BaseException:
        for child in children:
            child.kill()
            child.wait(timeout=CHILD_EXIT_WAIT_S)
        shutdown()
        raise
    model.attach_exchange(make_exchange(spec.exchange, group))
    leader = EPLeader(group, spec.device, spec.block_size, children)
    model.leader = leader
    return EPRun(group, leader, children)
