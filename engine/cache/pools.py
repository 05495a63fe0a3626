"""The caches one engine runs on, owned by its scheduler: KV blocks and their store, SSM slots, the
InnerQ handle of a quantized store, and the prefix cache.

The scheduler admits and releases sequences here, sets the block cap, normalizes SSM state and
polls InnerQ; the runner reads the stores while it runs a forward and takes the blocks that forward
needs (``allocate``: all of them or none, so ``KVCacheExhausted`` leaves nothing behind).
An MLA model's cache is the same blocks over a ``LatentKVStore`` (one latent row per token).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.cache.innerq import InnerQCache
from engine.cache.kv import BlockManager
from engine.cache.kv_calibration import STATE_OFF
from engine.cache.kv_quant import InnerQConfig, fp_block_bytes
from engine.cache.kv_store import KVStore
from engine.cache.latent_store import LatentKVStore, build_latent_cache
from engine.cache.prefix_pool import PrefixPool
from engine.cache.sequence import SequenceState
from engine.cache.ssm_pool import SSMPool
from engine.multimodal.encoder_cache import EncoderCache

Growth = list[tuple[SequenceState, int]]   # (sequence, its block count before an allocation)


@dataclass
class CachePools:
    blocks: BlockManager              # KV block bookkeeping (free / in use / evictable, ref counts, cap)
    kv_store: KVStore | LatentKVStore  # the K/V tensors (a QuantKVStore under InnerQ, latents for MLA)
    ssm: SSMPool                      # linear-attention state slots and snapshots
    fp_block_bytes: int               # bytes of one full-precision (or latent) block: the byte budget's unit
    innerq: InnerQCache | None = None
    prefix: PrefixPool | None = None
    encoder: EncoderCache | None = None   # vision-tower outputs by image hash (a model with a vision tower)

    @classmethod
    def build(cls, model, num_kv_blocks: int, num_ssm_slots: int, *, block_size: int = 16,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              kv_quant: InnerQConfig | None = None, kv_budget_bytes: int | None = None,
              scratch: bool = False) -> CachePools:
        """The caches for ``model``. ``kv_budget_bytes`` (--kv-cache-mb) sizes the KV cache in bytes;
        without it an InnerQ cache gets the bytes ``num_kv_blocks`` full-precision blocks take.
        ``scratch``: a block and a slot no sequence owns, for a compiled step's padding rows."""
        config, device = model.config, torch.device(device)
        ssm = SSMPool(num_ssm_slots, len(config.linear_attention_layers), config.conv_dim,
                      config.linear_conv_kernel_dim, config.linear_num_value_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim, device=device, scratch_slot=scratch)
        # The MTP layers (if any) are K/V layers too: same blocks, same block tables.
        layers = list(model.kv_layer_ids)
        if model.is_mla:
            if kv_quant is not None:
                raise ValueError("--kv-quant: InnerQ quantizes per-head keys and values; an MLA model caches "
                                 "latents, which it does not support")
            blocks, store = build_latent_cache(layers, num_kv_blocks, block_size, config.latent_dim, dtype, device,
                                               kv_budget_bytes, scratch)
            return cls(blocks, store, ssm, store.block_bytes)
        kv_heads, head_dim = config.num_key_value_heads, config.head_dim
        block_bytes = fp_block_bytes(len(layers), block_size, kv_heads, head_dim, dtype)
        if kv_quant is not None:
            budget = kv_budget_bytes if kv_budget_bytes is not None else num_kv_blocks * block_bytes
            innerq = InnerQCache.build(layers, budget, block_size, kv_heads, head_dim, kv_quant, dtype, device,
                                       calib_layer_ids=list(config.full_attention_layers))
            return cls(innerq.manager, innerq.store, ssm, block_bytes, innerq)
        if kv_budget_bytes is not None:
            num_kv_blocks = kv_budget_bytes // block_bytes
            if num_kv_blocks < 1:
                raise ValueError(f"--kv-cache-mb: {kv_budget_bytes} bytes hold no KV block ({block_bytes} bytes each)")
        store = KVStore(layers, num_kv_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device,
                        scratch_block=scratch)
        return cls(BlockManager(num_kv_blocks, block_size), store, ssm, block_bytes)

    def with_prefix(self, prefix: PrefixPool | None) -> CachePools:
        """The same caches with ``prefix`` as their prefix cache (the scheduler's view of them)."""
        return dataclasses.replace(self, prefix=prefix)

    # ---- sequence lifetime ------------------------------------------------------------
    def admit(self, seq: SequenceState) -> None:
        """Give ``seq`` an SSM slot with zero state (raises SSMPoolExhausted when none is free); its
        images stay in the encoder cache while it holds the slot."""
        if seq.ssm_slot is None:
            seq.ssm_slot = self.ssm.allocate()
            self._hold_images(seq, self.encoder.acquire if self.encoder is not None else None)
        else:
            self.ssm.zero(seq.ssm_slot)
        seq.mtp_hidden = None

    def release(self, seq: SequenceState) -> None:
        """Free the sequence's KV blocks and SSM slot (and its hold on its images' encoder rows)."""
        self.blocks.free(seq)
        seq.mtp_hidden = None
        if seq.ssm_slot is not None:
            self.ssm.free(seq.ssm_slot)
            seq.ssm_slot = None
            self._hold_images(seq, self.encoder.release if self.encoder is not None else None)

    @staticmethod
    def _hold_images(seq: SequenceState, change) -> None:
        if change is not None and seq.images is not None:
            for span in seq.images.spans:
                change(span.image.content_hash)

    def normalize(self, seq: SequenceState, max_norm: float = 1e4) -> bool:
        """Bound the sequence's SSM state norms (after a prefill chunk); True when it acted."""
        if seq.ssm_slot is None:
            raise ValueError(f"request {seq.request_id} has no SSM slot: call admit() first")
        return self.ssm.normalize(seq.ssm_slot, max_norm)

    # ---- blocks for a forward -----------------------------------------------------------
    def allocate(self, grow: list[tuple[SequenceState, int]]) -> Growth:
        """Give every (sequence, new tokens) its new blocks, or none of them (KVCacheExhausted leaves
        no trace); returns what ``undo`` needs."""
        grown: Growth = []
        try:
            for seq, num_new in grow:
                before = len(seq.block_table)
                self.blocks.allocate(seq, num_new)
                grown.append((seq, before))
        except Exception:
            self.undo(grown)
            raise
        return grown

    def undo(self, grown: Growth) -> None:
        """Drop the blocks an ``allocate`` appended."""
        for seq, before in grown:
            while len(seq.block_table) > before:
                self.blocks.decref(seq.block_table.pop())

    # ---- KV cache format (InnerQ) ----------------------------------------------------------
    @property
    def kv_quant_state(self) -> str:
        """off (full precision), or the InnerQ calibration state: calibrating / ready / applied."""
        return self.innerq.state if self.innerq is not None else STATE_OFF

    def poll_kv_quant(self) -> dict | None:
        """The reference's ``poll_innerq`` (start of every prefill chunk): a state change, or None."""
        return self.innerq.poll() if self.innerq is not None else None

    @property
    def kv_bytes_used(self) -> int:
        if self.innerq is not None:
            return self.innerq.manager.bytes_used
        return self.blocks.num_used * self.fp_block_bytes

    @property
    def kv_bytes_total(self) -> int:
        if self.innerq is not None:
            return self.innerq.manager.budget_bytes
        return self.blocks.num_blocks * self.fp_block_bytes
