"""``python -m engine generate``: one prompt through the model runner, printed as JSON or text."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.cli.compile_args import add_compile_args
from engine.cache.kv_options import budget_bytes, kv_quant_config
from engine.cli import args as cli_args
from engine.cli.generate_grammar import grammar_from_args, grammar_state
from engine.cli.kv_cache_args import add_kv_cache_args, kv_cache_options
from engine.grammar import masks
from engine.distributed import launch
from engine.model.compiled_decode import CompileSettings, resolve_compile, use_persistent_cache
from engine.model.loader import load_model
from engine.model.tiny import cache_root
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from engine.serve.driver import TickDriver
from engine.spec.kinds import SPECULATION_KINDS
from engine.scheduler.sampling import SamplingParams, make_generator, sample_next
from engine.cache.sequence import SequenceState
from telemetry.cli_args import bounded_int
from telemetry import events as ev
from telemetry.levers import LEVERS_BY_NAME, defaults

PREFILL_CHUNK = 512  # bounds peak activation memory on long prompts


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def runner_sizes(prompt_len: int, max_tokens: int) -> tuple[int, int]:
    """(KV blocks, SSM slots) for one sequence of prompt + max_tokens tokens."""
    return -(-(prompt_len + max_tokens) // 16) + 1, 1


def check_request(model, prompt: list[int], params: SamplingParams) -> int:
    """Refuse a prompt or sampling the model cannot run (one-line ValueError); returns prompt + max tokens."""
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
    return total


def generate(model, tokenizer, prompt: list[int], params: SamplingParams, stop_at_eos: bool = True,
             grammar: dict | None = None, kv_cache: dict | None = None,
             runner: ModelRunner | None = None, compile: CompileSettings | None = None,
             images=None) -> dict:
    """Greedy or sampled continuation of ``prompt``; returns {"tokens": [...], "text": str | None}, plus
    "kv_cache_dtype" and "kv_quant_state" with InnerQ. ``kv_cache``: ``kv_cache_options`` (default auto).

    ``grammar`` (``engine/grammar/spec.py``) constrains the output: every step's logits are
    masked, and generation stops when the grammar is complete ("finish_reason": "stop").
    ``runner``: one sized by ``runner_sizes`` (expert parallelism builds it before the ranks start).
    ``compile``: decode steps through the compiled step (compiled on first use; "compile" in the result
    gives the backend, seconds and graphs).
    ``images``: the prompt's ``PromptImages`` (``engine/multimodal/``) when it holds images.
    """
    kv_cache = kv_cache or {"kv_cache_dtype": "auto"}
    check_request(model, prompt, params)
    if runner is None:
        kv_blocks, ssm_slots = runner_sizes(len(prompt), params.max_tokens)
        weight = next(model.parameters())   # the caches hold what the weights compute in (bfloat16 too)
        runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots, device=weight.device,
                                   dtype=weight.dtype, kv_quant=kv_quant_config(kv_cache),
                                   kv_budget_bytes=budget_bytes(kv_cache), compile=compile)
    seq = SequenceState(request_id=0, images=images)
    runner.pools.admit(seq)
    eos_ids = {model.eos_token_id} if model.eos_token_id is not None else set()
    generator = make_generator(params.seed)
    state = grammar_state(model, tokenizer, grammar) if grammar is not None else None
    finish = "length"
    logits = None
    for offset in range(0, len(prompt), PREFILL_CHUNK):
        length = min(PREFILL_CHUNK, len(prompt) - offset)
        runner.pools.poll_kv_quant()  # as the scheduler: InnerQ's calibration moves on before each chunk
        logits = runner.prefill_chunk(seq, prompt, offset, length, offset + length == len(prompt))
    tokens: list[int] = []
    while True:
        row = logits[None] if state is None else masks.constrain(logits[None], [state])[0]   # [1, V]
        token = int(sample_next(row, [params], [generator], [len(tokens)], eos_ids,
                                output_tokens=[tokens], prompt_tokens=[prompt])[0])
        tokens.append(token)
        if state is not None and not state.advance(token):
            raise ValueError(f"grammar: {state.failure}")
        if token in params.stop_token_ids or (state is not None and state.is_stopped):
            finish = "stop"
        elif stop_at_eos and token in eos_ids:
            finish = "eos"
        if finish != "length" or len(tokens) >= params.max_tokens:
            break
        logits = runner.decode([seq], [token])[0]
    runner.pools.release(seq)
    text = tokenizer.decode([t for t in tokens if t not in eos_ids]) if tokenizer is not None else None
    result = {"tokens": tokens, "text": text, "finish_reason": finish}
    if state is not None:
        result["grammar_complete"] = state.is_accepting
    if runner.pools.innerq is not None:
        result.update(kv_cache_dtype=kv_cache["kv_cache_dtype"], kv_quant_state=runner.pools.kv_quant_state)
    if runner.compiled_decode is not None:
        compiled = runner.compiled_decode
        result["compile"] = {"backend": compiled.settings.backend, "compile_s": round(compiled.compile_seconds, 3),
                             "num_graphs": compiled.num_graphs, "num_recompiles": compiled.num_recompiles}
    return result


def generate_speculative(model, tokenizer, prompt: list[int], params: SamplingParams, speculation: str,
                         num_speculative_tokens: int, stop_at_eos: bool = True,
                         kv_cache: dict | None = None) -> dict:
    """As ``generate``, through the scheduler with the ``speculation`` lever set (the speculative step
    lives there); adds ``"spec": {"drafted", "accepted", "steps"}`` summed over its steps."""
    total = check_request(model, prompt, params) + num_speculative_tokens + 1  # + a last step's drafts
    levers = defaults().replace(speculation=speculation, num_speculative_tokens=num_speculative_tokens)
    rows: list = []
    weight = next(model.parameters())
    kv_cache = kv_cache or {"kv_cache_dtype": "auto"}
    runner = ModelRunner.build(model, num_kv_blocks=-(-total // 16) + 1, num_ssm_slots=1, device=weight.device,
                               dtype=weight.dtype, kv_quant=kv_quant_config(kv_cache),
                               kv_budget_bytes=budget_bytes(kv_cache))
    sched = Scheduler(runner, levers, emit=rows.append, eos_ids=None if stop_at_eos else ())
    refused = [r.reason for r in rows if isinstance(r, ev.LeverChange) and r.status == "rejected"]
    if refused:
        raise ValueError(f"--speculation {speculation}: {refused[0]}")
    request = sched.submit(0, prompt, params.to_dict())
    if request.error is not None:
        raise ValueError(request.error)
    TickDriver(sched).run()
    if request.error is not None:
        raise RuntimeError(f"generation failed: {request.error}")
    steps = [r.detail for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"
             and r.detail["num_drafted"]]
    eos_ids = {model.eos_token_id} if model.eos_token_id is not None else set()
    tokens = list(request.output_tokens)
    text = tokenizer.decode([t for t in tokens if t not in eos_ids]) if tokenizer is not None else None
    return {"tokens": tokens, "text": text,
            "spec": {"drafted": sum(d["num_drafted"] for d in steps),
                     "accepted": sum(d["num_accepted"] for d in steps), "steps": len(steps)}}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate a continuation for one prompt")
    parser.add_argument("--model", default="tiny", help="an embedded model (tiny, tiny-moe, tiny-kimi, tiny-vl; trained: tiny-chat, tiny-chat-moe) or a local HF checkpoint directory")
    parser.add_argument("--prompt-ids", type=str, default=None, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--prompt", type=str, default=None, help="prompt text (needs the model's tokenizer)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image the prompt starts with (repeatable; a model with a vision tower, e.g. tiny-vl)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--temperature", type=cli_args.finite_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0 = all)")
    parser.add_argument("--top-p", type=cli_args.finite_float, default=1.0,
                        help="sample from the smallest set of tokens holding this probability (1 = all)")
    parser.add_argument("--min-p", type=cli_args.finite_float, default=0.0,
                        help="drop tokens below this share of the likeliest one's probability (0 = none)")
    parser.add_argument("--seed", type=cli_args.seed, default=None, help="sampling seed (default: unseeded)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype (default float32)")
    parser.add_argument("--speculation", choices=SPECULATION_KINDS, default=None,
                        help='speculative decoding kind; adds "spec": {drafted, accepted, steps} to --json')
    k = LEVERS_BY_NAME["num_speculative_tokens"]
    parser.add_argument("--num-speculative-tokens", type=bounded_int(*k.bounds), default=k.default,
                        help=f"drafts per speculative step ({k.describe_range()})")
    parser.add_argument("--json", action="store_true", help='print {"tokens": [...], "text": ...}')
    parser.add_argument("--json-schema", default=None, metavar="FILE", help="constrain the output to this JSON schema")
    parser.add_argument("--regex", default=None, help="constrain the output to match this regex (fully)")
    parser.add_argument("--choice", default=None, metavar="A,B,...", help="the output is exactly one of these")
    add_kv_cache_args(parser)
    parser.add_argument("--threads", type=bounded_int(1, 1024), default=None,
                        help="torch CPU threads (default: torch's)")
    add_compile_args(parser)
    launch.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.prompt_ids is None) == (args.prompt is None):
        raise ValueError("give exactly one of --prompt-ids and --prompt")
    kv_cache = kv_cache_options(args)
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
    prompt, images = _with_images(args, model, prompt)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
    if args.ep > 1:
        if args.speculation is not None:
            raise ValueError("--speculation: not with --ep in generate (serve --ep runs speculation)")
        result = _generate_ep(args, model, tokenizer, prompt, params, images)
        if isinstance(result, int):  # a rank > 0 under torchrun: it ran the forwards, rank 0 prints
            return result
    elif args.speculation is None:
        settings = resolve_compile(args.compile, next(model.parameters()).device)
        if settings is not None:
            use_persistent_cache(cache_root() / "inductor")
        result = generate(model, tokenizer, prompt, params, stop_at_eos=not args.ignore_eos,
                          grammar=grammar_from_args(args), kv_cache=kv_cache, compile=settings, images=images)
    else:
        if grammar_from_args(args) is not None:
            raise ValueError("--speculation: give no --json-schema, --regex or --choice with it")
        result = generate_speculative(model, tokenizer, prompt, params, args.speculation,
                                      args.num_speculative_tokens, stop_at_eos=not args.ignore_eos,
                                      kv_cache=kv_cache)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"] if result["text"] is not None else " ".join(map(str, result["tokens"])))
    sys.stdout.flush()
    return 0


def _with_images(args: argparse.Namespace, model, prompt: list[int]):
    """``--image PATH``: (the images' placeholders, then the prompt; its ``PromptImages``), or (prompt, None)."""
    if not args.image:
        return prompt, None
    from engine.model.embedded import checkpoint_dir_of
    from engine.multimodal.limits import ImageError
    from engine.multimodal.request_images import RequestImages

    images = RequestImages.for_model(model, checkpoint_dir_of(args.model))
    if images is None or args.speculation is not None:
        raise ValueError(f"--image: {args.model} has no vision tower (try --model tiny-vl)" if images is None
                         else "--image: not with --speculation in generate")
    try:
        return images.prepend(prompt, [Path(path).read_bytes() for path in args.image])
    except OSError as exc:
        raise ValueError(f"--image {exc.filename}: {exc.strerror or exc}") from None
    except ImageError as exc:
        raise ValueError(f"--image: {exc}") from None


def _generate_ep(args: argparse.Namespace, model, tokenizer, prompt: list[int],
                 params: SamplingParams, images=None) -> dict | int:
    """``--ep N``: every rank runs the forwards; rank 0 samples. A rank > 0 returns its exit status."""
    from engine.distributed.worker import run_rank
    from engine.serve.engine_setup import checkpoint_hash
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
    runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots, dtype=spec.dtype)
    children = [] if from_torchrun else launch.spawn_ranks(spec)
    ep = launch.start_leader(model, runner, spec, digest, children)
    failed = True
    try:
        result = generate(model, tokenizer, prompt, params, stop_at_eos=not args.ignore_eos, runner=runner,
                          grammar=grammar_from_args(args), images=images)
        failed = False
    finally:
        ep.close(failed)
    return result
