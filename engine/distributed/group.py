"""The expert-parallel process group: start, bounded collectives, the start-time consistency check."""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.distributed import handshake
from engine.model.errors import RankFailure

DEFAULT_TIMEOUT_S = 10.0  # a peer that has not answered a collective by then is taken for dead
START_TIMEOUT_S = 180.0  # the rendezvous: every rank imports torch and loads its experts first


class StartMismatch(ValueError):
    """The ranks were started with different checkpoints or settings."""


@dataclass(frozen=True)
class EPGroup:
    rank: int
    size: int
    timeout_s: float
    backend: str

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_group(rank: int, size: int, timeout_s: float, device: torch.device,
               start_timeout_s: float = START_TIMEOUT_S) -> EPGroup:
    """Join the group at MASTER_ADDR / MASTER_PORT (as ``env://``); gloo on CPU, NCCL on CUDA.

    The rendezvous waits up to ``start_timeout_s`` (ranks import torch and load their experts
    at their own pace); ``timeout_s`` then bounds every collective.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        # Under torchrun the agent already serves the store at MASTER_PORT: every rank is a client.
        is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master,
                              timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=True)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # the store raises its own types (DistStoreError, RuntimeError, TimeoutError)
        raise RankFailure(f"expert-parallel rank {rank}: no rendezvous with {size} ranks within "
                          f"{start_timeout_s:g} s ({type(err).__name__}: {err})") from err
    return EPGroup(rank, size, timeout_s, backend)


@contextlib.contextmanager
def collective(group: EPGroup, what: str):
    """Any error inside (peer gone, timeout) becomes one RankFailure naming the step."""
    try:
        yield
    except RankFailure:
        raise
    except Exception as err:  # gloo / NCCL raise RuntimeError subclasses (DistBackendError, ...)
        raise RankFailure(f"expert-parallel {what} failed on rank {group.rank} of {group.size}: a peer rank "
                          f"died or did not answer within {group.timeout_s:g} s ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''})") from err


def check_start(group: EPGroup, checkpoint_hash: str, settings: dict, device: torch.device) -> None:
    """Every rank all-gathers every rank's fixed-size handshake (``handshake.py``); any field that
    differs fails the start on every rank, with the fields and each rank's value in the message."""
    mine = handshake.encode(checkpoint_hash, settings).to(device)
    every = [torch.empty_like(mine) for _ in range(group.size)]
    with collective(group, "start check"):
        dist.all_gather(every, mine)
    differing = handshake.disagreements([theirs.tolist() for theirs in every])
    if differing:
        raise StartMismatch(f"expert-parallel start check on rank {group.rank}: the ranks were started with a "
                            f"different checkpoint or settings ({'; '.join(differing)}); every rank needs the "
                            f"same checkpoint files, --ep, --kv-blocks, --ssm-slots and --dtype")


def shutdown() -> None:
    """Leave the group (a no-op when it was never joined or is already gone)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
