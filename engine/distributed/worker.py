"""A rank > 0: load its share of the experts, join the group, run every forward rank 0 broadcasts.

``python -m engine.distributed.worker`` is what ``--ep N`` spawns; under ``torchrun`` the ranks
> 0 of ``python -m engine serve|generate`` come here through ``run_rank`` instead. A rank never
schedules, samples or writes telemetry: it keeps its own K/V store and SSM pool in step with
rank 0's by running the same forwards on the same layout.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

import torch

from engine.distributed import control, vision_sync
from engine.distributed.exchange import EXCHANGE_ALL_TO_ALL, EXCHANGES, make_exchange
from engine.distributed.group import DEFAULT_TIMEOUT_S, EPGroup, StartMismatch, check_start, init_group, shutdown
from engine.distributed.leader import gather_timings
from engine.model.errors import RankFailure
from engine.model.runner import ModelRunner

log = logging.getLogger("chunkscope.ep")
EXIT_RANK_FAILURE = 3


def serve_forwards(group: EPGroup, model, runner: ModelRunner, device: torch.device) -> int:
    """Run broadcast forwards until rank 0 says stop; returns the number of forwards run."""
    num_forwards = 0
    while True:
        waited = time.perf_counter_ns()
        op, batch, rows = control.receive(group, runner.pools.ssm, device)
        received = time.perf_counter_ns() - waited
        if op == control.OP_STOP:
            return num_forwards
        if op != control.OP_FORWARD:
            continue  # idle keepalive
        embed = model.model.embed_tokens.weight
        vision_sync.receive(group, batch, embed.shape[1], embed.dtype, device)
        model.moe_timings.reset()
        start = time.perf_counter_ns()
        model(batch, runner.pools.kv_store, runner.pools.ssm, rows)
        forward_ns = time.perf_counter_ns() - start
        # ``received`` includes waiting for rank 0 to decide the forward: the wait is the broadcast seen from here.
        gather_timings(group, [received, model.moe_timings.expert_ns, model.moe_timings.exchange_ns, forward_ns],
                       device)
        num_forwards += 1


def run_rank(model, *, rank: int, size: int, kv_blocks: int, ssm_slots: int, block_size: int,
             dtype: torch.dtype, device: torch.device, timeout_s: float, exchange: str, checkpoint_hash: str) -> int:
    """The whole life of a rank > 0; returns its exit status (0 after rank 0's stop)."""
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots, block_size=block_size,
                               device=device, dtype=dtype)
    try:
        group = init_group(rank, size, timeout_s, device)
        check_start(group, checkpoint_hash, start_settings(size, kv_blocks, ssm_slots, block_size, dtype, exchange,
                                                           model.config.hidden_size), device)
        model.attach_exchange(make_exchange(exchange, group))
        num = serve_forwards(group, model, runner, device)
        log.info("expert-parallel rank %d: stop after %d forwards", rank, num)
        return 0
    except StartMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RankFailure as err:
        print(f"error: rank {rank}: {err}", file=sys.stderr)
        return EXIT_RANK_FAILURE
    finally:
        shutdown()


def start_settings(size: int, kv_blocks: int, ssm_slots: int, block_size: int, dtype: torch.dtype,
                   exchange: str, hidden_size: int) -> dict:
    """What every rank must agree on besides the checkpoint (the fields of ``handshake.FIELDS``)."""
    return {"ep": size, "kv_blocks": kv_blocks, "ssm_slots": ssm_slots, "block_size": block_size,
            "dtype": str(dtype).removeprefix("torch."), "exchange": exchange, "hidden_size": hidden_size}


def main(argv: list[str] | None = None) -> int:
    import os

    from engine.serve.engine_setup import checkpoint_hash
    from engine.model.embedded import checkpoint_dir_of
    from engine.model.loader import load_model

    parser = argparse.ArgumentParser(prog="python -m engine.distributed.worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-blocks", type=int, required=True)
    parser.add_argument("--ssm-slots", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--ep-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--ep-exchange", choices=EXCHANGES, default=EXCHANGE_ALL_TO_ALL)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 handles it and stops this rank with its stop word.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = int(os.environ["RANK"])
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    directory = checkpoint_dir_of(args.model)
    model, _, _ = load_model(directory, dtype=dtype, device=device, ep_rank=rank, ep_size=args.ep)
    return run_rank(model, rank=rank, size=args.ep, kv_blocks=args.kv_blocks, ssm_slots=args.ssm_slots,
                    block_size=args.block_size, dtype=dtype, device=device, timeout_s=args.ep_timeout,
                    exchange=args.ep_exchange, checkpoint_hash=checkpoint_hash(directory))


if __name__ == "__main__":
    sys.exit(main())
