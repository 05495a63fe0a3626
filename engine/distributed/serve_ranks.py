"""``serve --ep N``: bring the ranks up around a built engine, or run as a rank > 0 under torchrun."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from engine.distributed import launch
from engine.distributed.worker import run_rank

log = logging.getLogger("chunkscope.ep")


def _worker_args(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 block_size: int) -> launch.WorkerArgs:
    return launch.WorkerArgs(args.model, args.kv_blocks, args.ssm_slots, block_size, dtype, device,
                             args.threads or 1, args.ep, args.ep_timeout, args.ep_exchange)


def start(args: argparse.Namespace, setup, from_torchrun: bool, run_dir: Path) -> launch.EPRun:
    """Rank 0 of a serving run: spawn (unless torchrun did) and join the ranks; the scheduler sees ``is_ep``."""
    from engine.serve.engine_setup import checkpoint_hash

    runner = setup.runner
    spec = _worker_args(args, runner.device, runner.dtype, runner.kv_block_size)
    children = [] if from_torchrun else launch.spawn_ranks(spec)
    ep_run = launch.start_leader(setup.model, runner, spec, checkpoint_hash(setup.checkpoint_dir), children)
    sched = setup.scheduler
    setup.model.clock_ns = sched.now_ns
    ep_run.leader.attach_telemetry(sched.emit, sched.now_ns, lambda: sched.tick)
    ep_run.write_pids(run_dir)
    setup.engine_config["ep"] = {**ep_run.describe(), "exchange": args.ep_exchange}
    log.info("expert parallelism: %d ranks (%s, %s exchange, collective timeout %g s), rank pids %s",
             args.ep, ep_run.group.backend, args.ep_exchange, args.ep_timeout, ep_run.describe()["rank_pids"])
    return ep_run


def run_torchrun_rank(args: argparse.Namespace, rank: int) -> int:
    """A rank > 0 started by torchrun with the serve command line: load its experts, run forwards."""
    from engine.serve.engine_setup import BLOCK_SIZE, checkpoint_hash
    from engine.model.embedded import checkpoint_dir_of
    from engine.model.cpu_features import resolve_dtype
    from engine.model.loader import load_model

    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch.set_num_threads(args.threads or 1)
    # ``auto`` resolves here as on rank 0; on another kind of CPU it may not, and the start
    # handshake then fails the run naming the dtype of each rank (pass --dtype to settle it).
    dtype = getattr(torch, resolve_dtype(args.dtype, device=device.type))
    directory = checkpoint_dir_of(args.model)
    model, _, _ = load_model(directory, dtype=dtype, device=device, ep_rank=rank, ep_size=args.ep)
    return run_rank(model, rank=rank, size=args.ep, kv_blocks=args.kv_blocks, ssm_slots=args.ssm_slots,
                    block_size=BLOCK_SIZE, dtype=dtype, device=device, timeout_s=args.ep_timeout,
                    exchange=args.ep_exchange, checkpoint_hash=checkpoint_hash(directory))
