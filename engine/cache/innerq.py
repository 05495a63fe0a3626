"""The runner's handle on InnerQ: the calibration poll, and the window rule after every forward.

Ties the byte-budgeted block manager, the quantized store and the key calibration
together behind three calls: ``poll`` (start of every prefill chunk), ``after_forward``
(quantize the blocks a forward pushed out of the windows) and ``state``.
"""
from __future__ import annotations

import torch

from engine.cache.kv_budget import ByteBudgetBlockManager
from engine.cache.kv_calibration import STATE_APPLIED, KeyCalibration
from engine.cache.kv_quant import InnerQConfig, blocks_to_quantize, fp_block_bytes, quant_block_bytes
from engine.cache.kv_quant_store import QuantKVStore
from engine.cache.sequence import SequenceState


class InnerQCache:
    def __init__(self, manager: ByteBudgetBlockManager, store: QuantKVStore, calibration: KeyCalibration,
                 config: InnerQConfig):
        self.manager, self.store, self.calibration, self.config = manager, store, calibration, config
        self.num_quantized_blocks = 0   # blocks moved to the quantized format so far (a counter)

    @classmethod
    def build(cls, layer_ids: list[int], budget_bytes: int, block_size: int, num_kv_heads: int, head_dim: int,
              config: InnerQConfig, dtype: torch.dtype, device,
              calib_layer_ids: list[int] | None = None) -> InnerQCache:
        """``calib_layer_ids``: the layers whose keys are calibrated and normalized (default all); the
        others (an MTP module's, which sees no prefill keys of its own) are quantized unnormalized."""
        config = config.for_head_dim(head_dim)
        manager = ByteBudgetBlockManager(
            budget_bytes, fp_block_bytes(len(layer_ids), block_size, num_kv_heads, head_dim, dtype),
            quant_block_bytes(len(layer_ids), block_size, num_kv_heads, head_dim, config), block_size)
        calibration = KeyCalibration(layer_ids if calib_layer_ids is None else calib_layer_ids, num_kv_heads, head_dim, config.calib_tokens, device)
        store = QuantKVStore(layer_ids, manager, num_kv_heads, head_dim, config, calibration, dtype, device)
        return cls(manager, store, calibration, config)

    @property
    def state(self) -> str:
        return self.calibration.state

    def poll(self) -> dict | None:
        """The reference's ``poll_innerq``: move the calibration on; a dict describing the change, or None."""
        change = self.calibration.poll()
        if change is None:
            return None
        if change[1] == STATE_APPLIED:
            self.store.apply_calibration()
        return {"old": change[0], "new": change[1], **self.calibration.describe(),
                "kv_cache_dtype": self.config.dtype_name, "blocks_in_use": self.manager.num_used,
                "blocks_quantized": self.manager.num_quantized}

    def after_forward(self, moved: list[tuple[SequenceState, int]]) -> int:
        """``moved``: (sequence, cached tokens before the forward). Quantizes every block that left
        the sink and recent windows and was written after the calibration was applied; returns how many."""
        num = 0
        cfg, bs = self.config, self.manager.block_size
        for seq, before in moved:
            for index in blocks_to_quantize(before, seq.num_cached_tokens, bs, cfg.sink_tokens, cfg.recent_tokens):
                block_id = seq.block_table[index]
                if self.manager.is_quantizable(block_id):
                    self.store.quantize_block(block_id)
                    num += 1
        self.num_quantized_blocks += num
        return num
