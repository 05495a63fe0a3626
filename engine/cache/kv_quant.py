"""InnerQ KV-cache quantization: groups, windows and the per-group numbers.

After Tayaranian Hosseini, Ardakani and Gross, "InnerQ: Hardware-aware Tuning-free
Quantization of KV Cache for Large Language Models" (arXiv 2602.23200). The paper could
not be read here; this follows the scheme as the issue states it, with these choices:

* **Groups along the inner (head) dimension.** Each token's key (and value) vector of one
  KV head is cut into groups of ``group_size`` consecutive channels; every group has its
  own scale and zero point. Grouping along the dimension that a q·k or p·V dot product
  sums over means a fused kernel dequantizes one group with one scale inside the dot
  product (the paper's "hardware-aware" point).
* **Symmetric or asymmetric per group, chosen from the group's own statistics.** Symmetric
  (codes centred on zero, zero exactly representable, a kernel needs no zero-point add)
  when its step is at most ``symmetric_tolerance`` (1.15) times the asymmetric step;
  a group that straddles zero evenly takes it, a one-sided group goes asymmetric. Both are
  stored as ``x = code * scale + zero`` (symmetric: ``zero = -2^(bits-1) * scale``, exact in
  fp16), so reading is one formula. Scale and zero are fp16.
* **Full-precision windows**: the first ``sink_tokens`` (default 16, the attention sink)
  and the most recent ``recent_tokens`` (default 32) of every sequence stay full precision.
  Windows are kept at block granularity (16-token blocks): a block is quantized once every
  one of its positions is past the sink and older than the recent window.
* **4-bit values packed two to a byte** (low nibble = even channel); 8-bit one per byte.
* Per-channel key normalization (calibration, folded into the query) lives in
  ``kv_calibration.py``; the byte-budgeted block manager in ``kv_budget.py``; the tensors in
  ``kv_quant_store.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

KV_CACHE_DTYPES = ("auto", "innerq8", "innerq4")
BITS = {"innerq8": 8, "innerq4": 4}
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0 ** -20  # a constant group still gets a positive, fp16-representable scale


@dataclass(frozen=True)
class InnerQConfig:
    bits: int
    group_size: int = 32
    sink_tokens: int = 16
    recent_tokens: int = 32
    calib_tokens: int = 512          # prefill keys seen before the key scales are computed
    symmetric_tolerance: float = 1.15

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"InnerQ bits must be 4 or 8, got {self.bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"--kv-group-size must be an even number >= 2, got {self.group_size}")
        if self.sink_tokens < 0:
            raise ValueError(f"--kv-sink-tokens must be >= 0, got {self.sink_tokens}")
        if self.recent_tokens < 1:
            # The block being written must stay full precision: a window of at least one token.
            raise ValueError(f"--kv-recent-tokens must be >= 1, got {self.recent_tokens}")
        if self.calib_tokens < 1:
            raise ValueError(f"--kv-calib-tokens must be >= 1, got {self.calib_tokens}")

    @property
    def dtype_name(self) -> str:
        return f"innerq{self.bits}"

    def for_head_dim(self, head_dim: int) -> InnerQConfig:
        """The group size clipped to the head dim (which it must divide)."""
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise ValueError(f"--kv-group-size {group} does not divide the model's head_dim {head_dim}")
        return replace(self, group_size=group)

    def describe(self) -> dict:
        return {"kv_cache_dtype": self.dtype_name, "kv_group_size": self.group_size,
                "kv_sink_tokens": self.sink_tokens, "kv_recent_tokens": self.recent_tokens,
                "kv_calib_tokens": self.calib_tokens}


def config_for(kv_cache_dtype: str, **overrides) -> InnerQConfig | None:
    """``auto`` -> None (the model dtype, no quantization); ``innerq8`` / ``innerq4`` -> a config."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in BITS:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return InnerQConfig(bits=BITS[kv_cache_dtype], **{k: v for k, v in overrides.items() if v is not None})


# ---- sizes ------------------------------------------------------------------------------------

def code_width(head_dim: int, bits: int) -> int:
    """Bytes of codes per token and head."""
    return head_dim * bits // 8


def fp_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes of one full-precision block over every attention layer, K and V."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def quant_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                      config: InnerQConfig) -> int:
    """Bytes of one quantized block: codes plus an fp16 scale and zero per group, K and V."""
    groups = head_dim // config.group_size
    per_token_head = code_width(head_dim, config.bits) + groups * 2 * torch.empty((), dtype=SCALE_DTYPE).element_size()
    return num_layers * 2 * block_size * num_kv_heads * per_token_head


# ---- the numbers ---------------------------------------------------------------------------

def quantize(x: torch.Tensor, bits: int, group_size: int,
             symmetric_tolerance: float = 1.15) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (codes uint8 [..., D * bits / 8], scale fp16 [..., G], zero fp16 [..., G])."""
    levels = 2 ** bits - 1
    mid = 2 ** (bits - 1)
    groups = x.float().unflatten(-1, (-1, group_size))  # [..., G, g]
    lo, hi = groups.amin(-1), groups.amax(-1)  # [..., G]
    asym_step = (hi - lo) / levels
    # Symmetric codes use mid-(mid-1) .. mid+(mid-1): 2^bits - 1 levels around an exact zero.
    sym_step = 2 * torch.maximum(lo.abs(), hi.abs()) / (levels - 1)
    symmetric = sym_step <= symmetric_tolerance * asym_step
    scale = _fp16_at_least(torch.where(symmetric, sym_step, asym_step).clamp_min(MIN_SCALE))
    zero = torch.where(symmetric, -mid * scale.float(), lo).to(SCALE_DTYPE)
    # Codes from the fp16-rounded scale and zero, so reading back uses exactly these numbers.
    codes = ((groups - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8).flatten(-2)  # [..., D]
    return pack(codes, bits), scale, zero


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """fp16 values >= x: a scale rounded down would let the top of the group fall off the codes."""
    rounded = x.to(SCALE_DTYPE)
    low = rounded.float() < x
    return torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize``: [..., D * bits / 8] codes -> [..., D] in ``dtype``."""
    values = unpack(codes, bits).to(torch.float32).unflatten(-1, (-1, group_size))  # [..., G, g]
    values = values * scale.float()[..., None] + zero.float()[..., None]
    return values.flatten(-2).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] -> [..., D] (8-bit) or [..., D / 2], two 4-bit codes a byte (even channel low)."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # [..., D]


# ---- windows (pure) ---------------------------------------------------------------------------

def num_blocks_before_window(num_tokens: int, block_size: int, recent_tokens: int) -> int:
    """Leading blocks whose every position is older than the recent window."""
    return max(0, num_tokens - recent_tokens) // block_size


def blocks_to_quantize(num_before: int, num_after: int, block_size: int, sink_tokens: int,
                       recent_tokens: int) -> range:
    """Block indices a forward that took a sequence from ``num_before`` to ``num_after`` cached
    tokens may have pushed out of the windows: every index past the sink up to the window,
    whenever the window start crossed a block boundary (callers skip blocks already quantized,
    or written before the calibration was applied), and nothing otherwise."""
    sink_blocks = -(-sink_tokens // block_size)
    last_after = num_blocks_before_window(num_after, block_size, recent_tokens)
    if last_after <= num_blocks_before_window(num_before, block_size, recent_tokens):
        return range(0)
    return range(sink_blocks, last_after)
