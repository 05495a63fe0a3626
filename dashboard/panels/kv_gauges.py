"""The Live page's KV cache texts: token and byte gauges, and the KV quantization state line (pure)."""
from __future__ import annotations

MIB = 2 ** 20


def _is_number(value) -> bool:
    # A tick row of an older store reads NULL (None, or NaN through pandas) for the newer columns.
    return isinstance(value, (int, float)) and value == value


def kv_gauges(tick: dict) -> tuple[str, str]:
    """(tokens "used / total", MiB "used / total") from the latest ``ticks`` row; '-' where the
    store predates those columns."""
    tokens = (f"{int(tick['kv_tokens_used']):,} / {int(tick['kv_tokens_total']):,}"
              if _is_number(tick.get("kv_tokens_used")) and _is_number(tick.get("kv_tokens_total")) else "-")
    size = (f"{tick['kv_bytes_used'] / MIB:.1f} / {tick['kv_bytes_total'] / MIB:.1f}"
            if _is_number(tick.get("kv_bytes_used")) and _is_number(tick.get("kv_bytes_total")) else "-")
    return tokens, size


def kv_kind_caption(config: dict | None) -> str:
    """'; KV cache: MLA latent rows, 80 values per token and layer (per-head K/V: 320, 4.0x)' for an MLA
    run, '' for per-head K/V or a run that predates the field."""
    if not config or config.get("kv_kind") != "mla_latent":
        return ""
    latent, full = config.get("kv_values_per_token_layer"), config.get("kv_full_values_per_token_layer")
    if not (_is_number(latent) and _is_number(full) and latent > 0):
        return "; KV cache: MLA latent rows"
    return (f"; KV cache: MLA latent rows, {int(latent)} values per token and layer "
            f"(per-head K/V: {int(full)}, {full / latent:.1f}x)")


def kv_quant_caption(status: dict | None) -> str:
    """'; KV cache innerq4: applied since tick 41' from the latest state change, '' without one."""
    if not status:
        return ""
    return f"; KV cache {status.get('kv_cache_dtype') or 'quantized'}: {status['new']} since tick {status['tick']}"
