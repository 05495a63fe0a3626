"""The KV-cache options shared by ``serve``, ``generate`` and ``replay`` (format and byte budget).

``--kv-cache-dtype auto`` keeps K/V in the model dtype; ``innerq8`` / ``innerq4`` quantize
them with InnerQ (``engine/cache/kv_quant.py``). ``--kv-cache-mb`` sizes the cache in bytes
instead of blocks. The chosen values travel in the run's config (``kv_cache_options``), so
a replay rebuilds the same cache.
"""
from __future__ import annotations

import argparse
from typing import Any

from engine.cache.kv_options import OPTION_KEYS, kv_quant_config
from engine.cache.kv_quant import KV_CACHE_DTYPES, InnerQConfig
from telemetry.cli_args import bounded_float, bounded_int

MAX_KV_CACHE_MB = float(1 << 22)   # 4 TiB: beyond it the cache cannot be allocated anyway
MAX_TOKENS = 1 << 30


def add_kv_cache_args(parser: argparse.ArgumentParser, *, from_run: bool = False) -> None:
    """``from_run``: every default is None, meaning "as the recorded run had it" (replay)."""
    base = InnerQConfig(bits=4)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None if from_run else "auto",
                        help="KV cache format: auto (the model dtype), innerq8 or innerq4 (InnerQ group-wise "
                             "quantization with full-precision sink and recent windows)"
                             + (" (default: the run's)" if from_run else ""))
    parser.add_argument("--kv-cache-mb", type=bounded_float(0.0, MAX_KV_CACHE_MB, low_open=True), default=None,
                        help="KV cache budget in MiB (overrides --kv-blocks: a quantized cache holds more tokens)")
    parser.add_argument("--kv-sink-tokens", type=bounded_int(0, MAX_TOKENS), default=None,
                        help=f"InnerQ: leading tokens kept full precision (default {base.sink_tokens})")
    parser.add_argument("--kv-recent-tokens", type=bounded_int(1, MAX_TOKENS), default=None,
                        help=f"InnerQ: most recent tokens kept full precision (default {base.recent_tokens})")
    parser.add_argument("--kv-calib-tokens", type=bounded_int(1, MAX_TOKENS), default=None,
                        help=f"InnerQ: prefill tokens calibrating the key scales (default {base.calib_tokens})")
    parser.add_argument("--kv-group-size", type=bounded_int(2, 1 << 16), default=None,
                        help=f"InnerQ: channels per quantization group (default {base.group_size})")


def kv_cache_options(args: argparse.Namespace, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options as ``build_engine`` keywords; unset ones fall back to ``recorded`` (a run's config)."""
    recorded = recorded or {}
    options = {}
    for key in OPTION_KEYS:
        value = getattr(args, key, None)
        options[key] = recorded.get(key) if value is None else value
    options["kv_cache_dtype"] = options["kv_cache_dtype"] or "auto"
    if options["kv_cache_mb"] is not None and not options["kv_cache_mb"] > 0:
        raise ValueError(f"--kv-cache-mb must be > 0, got {options['kv_cache_mb']}")
    kv_quant_config(options)  # reject bad values before a model loads
    return options
