"""The KV cache options as a run records them (format, byte budget, InnerQ windows), read back into
the cache's configuration: what ``build_engine`` and ``generate`` take, whatever command set them."""
from __future__ import annotations

from typing import Any

from engine.cache.kv_quant import InnerQConfig, config_for

OPTION_KEYS = ("kv_cache_dtype", "kv_cache_mb", "kv_sink_tokens", "kv_recent_tokens", "kv_calib_tokens",
               "kv_group_size")


def kv_quant_config(options: dict[str, Any]) -> InnerQConfig | None:
    return config_for(options.get("kv_cache_dtype") or "auto", sink_tokens=options.get("kv_sink_tokens"),
                      recent_tokens=options.get("kv_recent_tokens"), calib_tokens=options.get("kv_calib_tokens"),
                      group_size=options.get("kv_group_size"))


def budget_bytes(options: dict[str, Any]) -> int | None:
    mb = options.get("kv_cache_mb")
    return None if mb is None else int(float(mb) * 2 ** 20)
