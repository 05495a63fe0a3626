"""``python -m engine serve``: its options; the process itself is ``engine/serve/process.py``."""
from __future__ import annotations

import argparse

from engine.api.launch import add_arguments as add_api_arguments
from engine.cli import args as cli_args
from engine.cli.compile_args import add_compile_args
from engine.cli.kv_cache_args import add_kv_cache_args
from engine.distributed import launch
from engine.model.cpu_features import DTYPE_CHOICES
from engine.model.reproducible import NUMERICS_CHOICES
from engine.multimodal.limits import ImageError, ImageLimits, parse_mm_limits
from engine.serve import process
from telemetry.cli_args import bounded_float, bounded_int

MAX_KV_BLOCKS = 1 << 22   # 64M tokens of 16: beyond it the cache cannot be allocated anyway
MAX_SSM_SLOTS = 4096


def mm_limits(text: str) -> ImageLimits:
    try:
        return parse_mm_limits(text)
    except ImageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the engine in the background, writing telemetry")
    p.add_argument("--model", default="tiny", help="an embedded model (tiny: the default, tiny-moe, tiny-kimi, tiny-vl; trained: tiny-chat, what ./run.sh serves, and tiny-chat-moe) or a checkpoint directory")
    p.add_argument("--run-dir", required=True, help="directory for telemetry.db and levers.json")
    p.add_argument("--workload", default="synthetic",
                   help="synthetic | chat (chat-template requests: thinking, tools, JSON; needs a tokenizer) | multiturn | trace:PATH | bundle:PATH | none (API traffic only; default synthetic)")
    p.add_argument("--rate", type=bounded_float(0.0, 1e6, low_open=True), default=4.0,
                   help="arrival rate, requests/s (synthetic, chat, multiturn)")
    p.add_argument("--grammar-share", type=bounded_float(0.0, 1.0), default=0.0,
                   help="synthetic: share of requests constrained by a built-in JSON schema / regex / choice")
    p.add_argument("--image-share", type=bounded_float(0.0, 1.0), default=None,
                   help="share of workload requests with an image in front of the prompt (chat: opening the "
                        "user turn) on a model with a vision tower (tiny-chat, tiny-vl; default 0.5 there, 0 "
                        "otherwise)")
    p.add_argument("--limit-mm-per-prompt", type=mm_limits, default=None, metavar="JSON",
                   help='most images per request, as vLLM spells it: \'{"image": N}\' (0-64; 0 refuses images; '
                        'default 4) on a model with a vision tower')
    p.add_argument("--requests", type=cli_args.positive_int, default=None,
                   help="stop after this many requests (default: endless)")
    p.add_argument("--duration", type=cli_args.positive_float, default=None, help="stop after this many seconds")
    p.add_argument("--kv-blocks", type=bounded_int(1, MAX_KV_BLOCKS), default=512,
                   help="physical KV blocks (16 tokens each)")
    p.add_argument("--ssm-slots", type=bounded_int(1, MAX_SSM_SLOTS), default=32,
                   help="SSM state slots = most sequences at once")
    p.add_argument("--seed", type=cli_args.seed, default=0, help="workload and sampling seed")
    p.add_argument("--threads", type=bounded_int(1, 1024), default=None,
                   help="torch CPU threads (default: 1 for the tiny model, whose ops are too small to split)")
    p.add_argument("--time-scale", type=cli_args.positive_float, default=1.0, help="trace: multiply inter-arrival gaps")
    p.add_argument("--length-scale", type=cli_args.positive_float, default=1.0,
                   help="trace: multiply prompt/output lengths")
    p.add_argument("--limit", type=cli_args.positive_int, default=None, help="trace: number of rows to replay")
    p.add_argument("--start", type=cli_args.non_negative_int, default=0, help="trace: first row to replay")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prompt prefixes (KV blocks + SSM snapshots); default on")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="auto: bfloat16 where the CPU has AMX or AVX512-BF16, else float32 (recorded in the run row)")
    p.add_argument("--numerics", choices=NUMERICS_CHOICES, default="native",
                   help="reproducible: every reduction and transcendental in float64, rounded to --dtype, so a bundle "
                        "replays identically on another CPU family (slower: bench/numerics.py); recorded in the run row")
    p.add_argument("--no-telemetry", action="store_true", help="run without writing telemetry (benchmarks)")
    add_kv_cache_args(p)
    add_compile_args(p)
    launch.add_arguments(p)
    add_api_arguments(p)
    p.set_defaults(func=process.run)
