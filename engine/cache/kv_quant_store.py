"""Paged K/V tensors with InnerQ: full-precision slots for windows, quantized blocks for the rest.

Same interface as ``KVStore`` (``write``, ``gather``, ``scale_query``), addressed by the
block ids of ``ByteBudgetBlockManager``. A block's data lives either in a full-precision
slot (``fp_slot_of[block]``) or, once quantized, in the block's own row of the code,
scale and zero tensors. Attention reads through ``gather``, which dequantizes the quantized
blocks it touches (the CPU path; a fused dequantize-in-the-dot-product kernel is the GPU
path this layout was chosen for, not written here).
"""
from __future__ import annotations

import torch

from engine.cache.kv_budget import NO_SLOT, ByteBudgetBlockManager
from engine.cache.kv_calibration import STATE_APPLIED, STATE_CALIBRATING, KeyCalibration
from engine.cache.kv_quant import InnerQConfig, code_width, dequantize, quantize


class QuantizedKV:
    """Codes, scales and zeros of one layer's K or V: [num_blocks, block_size, Hkv, ...]."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 config: InnerQConfig, device):
        lead = (num_blocks, block_size, num_kv_heads)
        groups = head_dim // config.group_size
        self.codes = torch.zeros(*lead, code_width(head_dim, config.bits), dtype=torch.uint8, device=device)
        self.scale = torch.zeros(*lead, groups, dtype=torch.float16, device=device)
        self.zero = torch.zeros(*lead, groups, dtype=torch.float16, device=device)

    def store(self, block_id: int, values: torch.Tensor, config: InnerQConfig) -> None:
        """values: [block_size, Hkv, D]."""
        codes, scale, zero = quantize(values, config.bits, config.group_size, config.symmetric_tolerance)
        self.codes[block_id], self.scale[block_id], self.zero[block_id] = codes, scale, zero

    def load(self, block_ids: torch.Tensor, config: InnerQConfig, dtype: torch.dtype) -> torch.Tensor:
        """block_ids: [M] -> [M, block_size, Hkv, D]."""
        return dequantize(self.codes[block_ids], self.scale[block_ids], self.zero[block_ids],
                          config.bits, config.group_size, dtype)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


class QuantKVStore:
    def __init__(self, layer_ids: list[int], manager: ByteBudgetBlockManager, num_kv_heads: int, head_dim: int,
                 config: InnerQConfig, calibration: KeyCalibration, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.config = config
        self.calibration = calibration
        self.manager = manager
        self.block_size = block_size = manager.block_size
        self.num_blocks = manager.num_blocks
        self.dtype = dtype
        fp_shape = (manager.num_fp_slots, block_size, num_kv_heads, head_dim)
        self.keys = {i: torch.zeros(fp_shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(fp_shape, dtype=dtype, device=device) for i in layer_ids}
        self.qkeys = {i: QuantizedKV(self.num_blocks, block_size, num_kv_heads, head_dim, config, device)
                      for i in layer_ids}
        self.qvalues = {i: QuantizedKV(self.num_blocks, block_size, num_kv_heads, head_dim, config, device)
                        for i in layer_ids}
        self.fp_slot_of = torch.full((self.num_blocks,), NO_SLOT, dtype=torch.long, device=device)  # [N]
        manager.on_fp_slot = self._on_fp_slot
        self.query_scales: dict[int, torch.Tensor] = {}   # [Hkv, D] per layer once applied
        self.num_prefill_rows = 0   # rows of the current forward that are prefill (calibration input)

    def _on_fp_slot(self, block_id: int, slot: int) -> None:
        self.fp_slot_of[block_id] = slot

    # ---- the attention interface --------------------------------------------------------------
    def begin_forward(self, num_prefill_rows: int) -> None:
        self.num_prefill_rows = num_prefill_rows

    def scale_query(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D] -> q * s with s the key scales of each query head's KV head."""
        scales = self.query_scales.get(layer_id)
        if scales is None:
            return q
        group = q.shape[1] // scales.shape[0]
        return q * scales.repeat_interleave(group, dim=0).to(q.dtype)

    def write(self, layer_id: int, kv_slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """kv_slots: [T] logical (block * block_size + offset); key/value: [T, Hkv, D]. New tokens
        always land in full-precision blocks (the recent window holds the block being written)."""
        if self.calibration.state == STATE_CALIBRATING:
            self.calibration.observe(layer_id, key[: self.num_prefill_rows])
        scales = self.query_scales.get(layer_id)
        if scales is not None:
            key = key / scales.to(key.dtype)
        fp_slots = self.fp_slot_of[kv_slots // self.block_size]
        if bool((fp_slots < 0).any()):
            raise RuntimeError("a K/V write landed in a quantized block")
        physical = fp_slots * self.block_size + kv_slots % self.block_size
        kv_heads, head_dim = key.shape[1:]
        self.keys[layer_id].view(-1, kv_heads, head_dim).index_copy_(0, physical, key)
        self.values[layer_id].view(-1, kv_heads, head_dim).index_copy_(0, physical, value)

    def gather(self, layer_id: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids: [..., n] -> K, V of shape [..., n * block_size, Hkv, D], quantized blocks dequantized."""
        lead = block_ids.shape
        flat = block_ids.reshape(-1)  # [M]
        slots = self.fp_slot_of[flat]
        is_fp = slots >= 0
        fp_keys, fp_values = self.keys[layer_id], self.values[layer_id]
        if bool(is_fp.all()):
            k, v = fp_keys.index_select(0, slots), fp_values.index_select(0, slots)
        else:
            k = torch.empty((flat.shape[0], *fp_keys.shape[1:]), dtype=self.dtype, device=flat.device)
            v = torch.empty_like(k)
            k[is_fp], v[is_fp] = fp_keys[slots[is_fp]], fp_values[slots[is_fp]]
            quantized = flat[~is_fp]
            k[~is_fp] = self.qkeys[layer_id].load(quantized, self.config, self.dtype)
            v[~is_fp] = self.qvalues[layer_id].load(quantized, self.config, self.dtype)
        return (k.view(*lead[:-1], -1, *fp_keys.shape[2:]), v.view(*lead[:-1], -1, *fp_values.shape[2:]))

    # ---- format changes -----------------------------------------------------------------------------
    def quantize_block(self, block_id: int) -> None:
        """Move ``block_id`` from its full-precision slot into the quantized tensors (every layer)."""
        slot = self.manager.fp_slot(block_id)
        for layer_id in self.keys:
            self.qkeys[layer_id].store(block_id, self.keys[layer_id][slot], self.config)
            self.qvalues[layer_id].store(block_id, self.values[layer_id][slot], self.config)
        self.manager.mark_quantized(block_id)

    def apply_calibration(self) -> None:
        """Use the calibration's scales from now on: fold them into queries and normalize every
        key already stored (full precision: nothing is quantized before this), once."""
        assert self.calibration.state == STATE_APPLIED and self.calibration.scales is not None
        for layer_id, scales in self.calibration.scales.items():
            scales = scales.to(self.keys[layer_id].device)
            self.keys[layer_id].div_(scales.to(self.dtype))
            self.query_scales[layer_id] = scales
        self.manager.quantize_new_blocks = True

    @property
    def num_bytes(self) -> int:
        fp = sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
        return fp + sum(q.num_bytes for q in (*self.qkeys.values(), *self.qvalues.values()))
