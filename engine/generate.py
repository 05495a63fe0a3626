"""``python -m engine generate``: one prompt through the model runner, printed as JSON or text."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from engine.distributed import launch
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.sampling import SamplingParams, make_generator, sample_next
from engine.sequence import SequenceState
from telemetry import cli_args

PREFILL_CHUNK = 512  # bounds peak activation memory on long prompts


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def runner_sizes(prompt_len: int, max_tokens: int) -> tuple[int, int]:
    """(KV blocks, SSM slots) for one sequence of prompt + max_tokens tokens."""
    return -(-(prompt_len + max_tokens) // 16) + 1, 1


def generate(model, tokenizer, prompt: list[int], params: SamplingParams, stop_at_eos: bool = True,
             runner: ModelRunner | None = None) -> dict:
    """Greedy or sampled continuation of ``prompt``; returns {"tokens": [...], "text": str | None}.

    ``runner``: one sized by ``runner_sizes`` (expert parallelism builds it before the ranks start).
    """
    vocab = model.config.vocab_size
    if not prompt:
        raise ValueError("prompt is empty: give --prompt-ids or a non-empty --prompt")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"--prompt-ids: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    # Same limit as the scheduler's admission check (ModelConfig does not carry it yet).
    max_context = model.config.max_position_embeddings
    if len(prompt) >= max_context:
        raise ValueError(f"--prompt-ids: {len(prompt)} tokens do not fit the model's context of {max_context}")
    params.validate(vocab)
    total = len(prompt) + params.max_tokens
    if total > max_context:
        raise ValueError(f"--max-tokens {params.max_tokens}: with the {len(prompt)}-token prompt that is {total} "
                         f"tokens, more than the model's context of {max_context}")
    if runner is None:
        kv_blocks, ssm_slots = runner_sizes(len(prompt), params.max_tokens)
        weight = next(model.parameters())   # the caches hold what the weights compute in (bfloat16 too)
        runner = ModelRunner(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots, device=weight.device,
                             dtype=weight.dtype)
    seq = SequenceState(request_id=0)
    runner.admit(seq)
    eos_ids = {model.eos_token_id} if model.eos_token_id is not None else set()
    generator = make_generator(params.seed)
    logits = None
    for offset in range(0, len(prompt), PREFILL_CHUNK):
        length = min(PREFILL_CHUNK, len(prompt) - offset)
        logits = runner.prefill_chunk(seq, prompt, offset, length, offset + length == len(prompt))
    tokens: list[int] = []
    while True:
        token = int(sample_next(logits[None], [params], [generator], [len(tokens)], eos_ids)[0])
        tokens.append(token)
        if len(tokens) >= params.max_tokens or token in params.stop_token_ids or \
                (stop_at_eos and token in eos_ids):
            break
        logits = runner.decode([seq], [token])[0]
    runner.release(seq)
    text = tokenizer.decode([t for t in tokens if t not in eos_ids]) if tokenizer is not None else None
    return {"tokens": tokens, "text": text}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate a continuation for one prompt")
    parser.add_argument("--model", default="tiny", help="'tiny' or a local HF checkpoint directory")
    parser.add_argument("--prompt-ids", type=str, default=None, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--prompt", type=str, default=None, help="prompt text (needs the model's tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=cli_args.finite_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=cli_args.finite_float, default=1.0)
    parser.add_argument("--min-p", type=cli_args.finite_float, default=0.0)
    parser.add_argument("--seed", type=cli_args.seed, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", action="store_true", help='print {"tokens": [...], "text": ...}')
    parser.add_argument("--threads", type=cli_args.bounded_int(1, 1024), default=None,
                        help="torch CPU threads (default: torch's)")
    launch.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.prompt_ids is None) == (args.prompt is None):
        raise ValueError("give exactly one of --prompt-ids and --prompt")
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, _ = launch.rank_of(args.ep)
    model, _, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), ep_rank=rank, ep_size=args.ep)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt: {args.model} has no tokenizer.json; use --prompt-ids")
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = parse_ids(args.prompt_ids)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
    if args.ep > 1:
        result = _generate_ep(args, model, tokenizer, prompt, params)
        if isinstance(result, int):  # a rank > 0 under torchrun: it ran the forwards, rank 0 prints
            return result
    else:
        result = generate(model, tokenizer, prompt, params, stop_at_eos=not args.ignore_eos)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"] if result["text"] is not None else " ".join(map(str, result["tokens"])))
    sys.stdout.flush()
    return 0


def _generate_ep(args: argparse.Namespace, model, tokenizer, prompt: list[int],
                 params: SamplingParams) -> dict | int:
    """``--ep N``: every rank runs the forwards; rank 0 samples. A rank > 0 returns its exit status."""
    from engine.distributed.worker import run_rank
    from engine.engine_setup import checkpoint_hash
    from engine.model.embedded import checkpoint_dir_of

    rank, from_torchrun = launch.rank_of(args.ep)
    kv_blocks, ssm_slots = runner_sizes(len(prompt), params.max_tokens)
    spec = launch.WorkerArgs(args.model, kv_blocks, ssm_slots, 16, getattr(torch, args.dtype), torch.device("cpu"),
                             args.threads, args.ep, args.ep_timeout, args.ep_exchange)
    digest = checkpoint_hash(checkpoint_dir_of(args.model))
    if rank > 0:
        return run_rank(model, rank=rank, size=args.ep, kv_blocks=kv_blocks, ssm_slots=ssm_slots, block_size=16,
                        dtype=spec.dtype, device=spec.device, timeout_s=args.ep_timeout,
                        exchange=args.ep_exchange, checkpoint_hash=digest)
    runner = ModelRunner(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots, dtype=spec.dtype)
    children = [] if from_torchrun else launch.spawn_ranks(spec)
    ep = launch.start_leader(model, runner, spec, digest, children)
    failed = True
    try:
        result = generate(model, tokenizer, prompt, params, stop_at_eos=not args.ignore_eos, runner=runner)
        failed = False
    finally:
        ep.close(failed)
    return result
