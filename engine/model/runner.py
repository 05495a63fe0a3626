"""The forward API the scheduler calls: one ``ForwardBatch`` (a prefill chunk, decode rows, or both fused)
in, its logits out."""
from __future__ import annotations

import torch

from engine.cache.kv_quant import InnerQConfig
from engine.cache.pools import CachePools
from engine.cache.ssm_pool import SSMSnapshot
from engine.model.batch import PackedBatch, build_batch
from engine.model.forward_batch import ForwardBatch, ForwardOutput
from engine.model.compiled_decode import CompiledDecode, CompileSettings
from engine.model.fault import KIND_DECODE, KIND_MIXED, KIND_PREFILL, ForwardFault
from engine.model import mtp_feed
from engine.model.gdn import SSMCapture
from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.roofline import ForwardCost, forward_cost
from engine.multimodal.chunk_inputs import attach_images, shift_past_prompt
from engine.multimodal.encoder_cache import EncoderCache
from engine.cache.sequence import SequenceState


class ModelRunner:
    """Runs forwards (``forward(ForwardBatch)``) of one model over caches it is handed.

    The caches (``CachePools``) belong to the scheduler, which admits, releases and caps them;
    the runner takes the blocks a forward needs before running it (so ``KVCacheExhausted`` leaves
    everything unchanged) and advances ``seq.num_cached_tokens`` after it. A model call that
    raises gives its new blocks back and advances no count; only tensor contents may be
    half-written (the caller restores or discards them). ``fault``: the test-only fault hook
    (``engine/model/fault.py``).
    """

    def __init__(self, model: Qwen35ForCausalLM, pools: CachePools, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, fault: ForwardFault | None = None,
                 compile: CompileSettings | None = None):
        """``compile``: decode-only forwards through ``CompiledDecode`` (``compiled_decode.py``); the
        pools then need the scratch block and slot its padding rows write to (``CachePools.build``)."""
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        self.dtype = dtype
        self.pools = pools
        self.fault = fault
        # Keep the MTP layer's K/V in step with every forward (on while speculation = mtp).
        self.mtp_keep_up = False
        # FLOPs and bytes of the forwards run since the last ``take_forward_cost`` (the tick's roofline).
        self._forward_cost = ForwardCost(0.0, 0.0)
        # The compiled decode step (None: eager); an InnerQ cache calibrates in Python, so it stays eager.
        self.compiled_decode: CompiledDecode | None = None
        if compile is not None and pools.innerq is None and getattr(model, "supports_compiled_decode", False):
            self.compiled_decode = CompiledDecode(model, pools.kv_store, pools.ssm, pools.blocks.block_size,
                                                  compile, self.device)
        self.last_forward_compiled = False  # whether the last forward ran the compiled step
        # Vision-tower outputs by image content hash (engine/multimodal/encoder_cache.py), kept with
        # the other caches; the covered image spans of the last forward's chunk (telemetry reads them).
        if getattr(model, "visual", None) is not None and pools.encoder is None:
            pools.encoder = EncoderCache()
        self.last_image_spans: list = []

    @classmethod
    def build(cls, model: Qwen35ForCausalLM, num_kv_blocks: int, num_ssm_slots: int, block_size: int = 16,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              fault: ForwardFault | None = None, kv_quant: InnerQConfig | None = None,
              kv_budget_bytes: int | None = None, compile: CompileSettings | None = None) -> ModelRunner:
        """A runner over new caches of these sizes (``CachePools.build``)."""
        pools = CachePools.build(model, num_kv_blocks, num_ssm_slots, block_size=block_size, device=device,
                                 dtype=dtype, kv_quant=kv_quant, kv_budget_bytes=kv_budget_bytes,
                                 scratch=compile is not None)
        return cls(model, pools, device=device, dtype=dtype, fault=fault, compile=compile)

    # ---- properties the scheduler reads ----------------------------------------------
    @property
    def kv_block_size(self) -> int:
        return self.pools.blocks.block_size

    @property
    def is_mla(self) -> bool:
        return self.model.is_mla

    @property
    def is_ep(self) -> bool:
        return self.model.is_ep

    @property
    def ep_broadcast_ns(self) -> int | None:
        """Rank 0's broadcast before the last forward under expert parallelism, else None."""
        return getattr(self.model, "last_broadcast_ns", None)

    @property
    def ep_vision_sync_ns(self) -> int | None:
        """Rank 0's broadcast of the last forward's image rows under expert parallelism, else None."""
        return getattr(self.model, "last_vision_sync_ns", None)

    @property
    def encoder_cache(self) -> EncoderCache | None:
        return self.pools.encoder

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # ---- forwards -------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        """Run ``fb``: ONE forward over [prefill chunk rows | decode rows]."""
        chunk_spec, decode_seqs, decode_tokens = fb.prefill, list(fb.decode_seqs), list(fb.decode_tokens)
        prefill_seq = chunk_spec.seq if chunk_spec is not None else None
        if len(decode_seqs) != len(decode_tokens):
            raise ValueError(f"decode_tokens has {len(decode_tokens)} ids for {len(decode_seqs)} sequences")
        if prefill_seq is None and not decode_seqs:
            raise ValueError("a forward needs a prefill chunk or at least one decode sequence")
        chunk: list[int] = []
        offset, length, is_last, capture_at = 0, 0, False, None
        if chunk_spec is not None:
            offset, length, is_last, capture_at = (chunk_spec.offset, chunk_spec.length, chunk_spec.is_last,
                                                   chunk_spec.capture_at)
            chunk = self._check_chunk(prefill_seq, chunk_spec.prompt, offset, length)
        if capture_at is not None and not offset < capture_at < offset + length:
            raise ValueError(f"capture_at={capture_at} must lie strictly inside the prefill chunk "
                             f"[{offset}, {offset + length})")
        self._check_tokens(decode_tokens, "decode_tokens")
        for seq in decode_seqs:
            self._slot(seq)
        grown = self.pools.allocate([(s, 1) for s in decode_seqs] + ([(prefill_seq, length)] if prefill_seq else []))
        moved = [(seq, seq.num_cached_tokens) for seq in fb.sequences]

        prefill = None
        if prefill_seq is not None:
            prefill = (chunk, prefill_seq.num_cached_tokens, prefill_seq.block_table, prefill_seq.ssm_slot)
        decodes = [(tok, seq.num_cached_tokens, seq.block_table, seq.ssm_slot)
                   for seq, tok in zip(decode_seqs, decode_tokens)]
        every_row = chunk_spec is not None and chunk_spec.every_row
        num_prefill_rows = len(chunk) if every_row else int(prefill_seq is not None and is_last)
        rows = list(range(len(chunk) - num_prefill_rows, len(chunk) + len(decode_seqs)))
        capture = None
        self.last_forward_compiled = prefill_seq is None and self._may_compile(len(decode_seqs))
        if self.last_forward_compiled:
            logits = self._compiled_logits(decodes, grown)  # [B, V]
        else:
            batch = build_batch(prefill, decodes, self.kv_block_size, self.device)
            if capture_at is not None:
                capture = SSMCapture(num_rows=capture_at - offset)
                batch.ssm_capture = capture  # read by every GatedDeltaNet layer of this forward
            logits = self._call_model(batch, rows, grown, prefill_seq, decode_seqs)  # [R, V]
        self.note_forward(len(chunk), prefill_seq.num_cached_tokens if prefill_seq is not None else 0,
                          [seq.num_cached_tokens + 1 for seq in decode_seqs], len(rows))

        captured = self._capture_snapshot(capture, prefill_seq) if capture is not None else None
        if prefill_seq is not None:
            prefill_seq.num_cached_tokens += length
        for seq in decode_seqs:
            seq.num_cached_tokens += 1
        if self.pools.innerq is not None:
            self.pools.innerq.after_forward(moved)  # blocks that left the windows become 4/8-bit
        prefill_logits = logits[num_prefill_rows - 1] if prefill_seq is not None and is_last else None
        chunk_logits = logits[:num_prefill_rows] if every_row else None                 # [length, V]
        return ForwardOutput(prefill_logits, logits[num_prefill_rows:], captured, chunk_logits)

    def prefill_chunk(self, seq: SequenceState, prompt: list[int], offset: int, length: int,
                      is_last: bool) -> torch.Tensor | None:
        """One plain chunk (a standalone caller's shorthand for ``forward``); logits [V] when ``is_last``."""
        return self.forward(ForwardBatch.chunk(seq, prompt, offset, length, is_last)).prefill_logits

    def decode(self, seqs: list[SequenceState], tokens: list[int]) -> torch.Tensor:
        """One token per sequence (a standalone caller's shorthand for ``forward``); logits [B, V]."""
        return self.forward(ForwardBatch.decode(seqs, tokens)).decode_logits

    def _may_compile(self, rows: int) -> bool:
        """A decode-only forward the compiled step serves: no fault hook, no MTP rows, a bucket that fits."""
        return (self.compiled_decode is not None and self.fault is None and self.compiled_decode.accepts(rows)
                and not (self.mtp_keep_up and self.model.has_mtp_head))

    def _compiled_logits(self, decodes, grown) -> torch.Tensor:
        """``forward``'s decode-only case through the compiled step; logits [B, V]; on an
        error the new blocks go back."""
        try:
            return self.compiled_decode(decodes)  # [B, V]
        except Exception:
            self.pools.undo(grown)
            raise

    def take_compile_events(self) -> list[dict]:
        """The compiled step's compiles since the last call (``CompiledDecode.take_events``)."""
        return self.compiled_decode.take_events() if self.compiled_decode is not None else []

    # ---- roofline accounting ----------------------------------------------------------------
    def note_forward(self, prefill_tokens: int, prefill_start: int, decode_contexts: list[int],
                     logits_rows: int) -> None:
        """Add one forward's FLOPs and bytes (``roofline.forward_cost``) to the running total."""
        self._forward_cost = self._forward_cost + forward_cost(
            self.config, self.dtype.itemsize, prefill_tokens, prefill_start, decode_contexts, logits_rows)

    def take_forward_cost(self) -> ForwardCost:
        """The cost of the forwards since the last call, and start a new total."""
        cost, self._forward_cost = self._forward_cost, ForwardCost(0.0, 0.0)
        return cost

    # ---- helpers ----------------------------------------------------------------------------
    def _call_model(self, batch: PackedBatch, rows: list[int], grown: list[tuple[SequenceState, int]],
                    prefill_seq: SequenceState | None, decode_seqs: list[SequenceState]) -> torch.Tensor:
        """The model over ``batch``, logits [R, V] at ``rows``; on an error the new blocks go back."""
        # Every row wants logits (a decode-only forward): no index_select of the last layer's rows.
        row_ids = None if rows == list(range(batch.num_tokens)) else torch.tensor(rows, dtype=torch.long,
                                                                                    device=self.device)
        self.pools.kv_store.begin_forward(batch.num_prefill_tokens)  # InnerQ calibrates on prefill keys
        try:
            if self.pools.encoder is not None:   # M-RoPE positions and the tower's rows (chunk_inputs.py)
                offset = prefill_seq.num_cached_tokens if prefill_seq is not None else 0
                self.last_image_spans = attach_images(batch, prefill_seq, offset, batch.num_prefill_tokens,
                                                      decode_seqs, self.model.visual, self.pools.encoder)
            if self.fault is None:
                return self._model_and_mtp(batch, row_ids, prefill_seq, decode_seqs)
            kind = KIND_DECODE if prefill_seq is None else KIND_MIXED if decode_seqs else KIND_PREFILL
            ids = [s.request_id for s in ([prefill_seq] if prefill_seq is not None else []) + decode_seqs]
            with self.fault.armed(self.model, kind, ids):
                return self._model_and_mtp(batch, row_ids, prefill_seq, decode_seqs)
        except Exception:
            self.pools.undo(grown)
            raise
        finally:
            self.pools.kv_store.begin_forward(0)  # a forward built elsewhere (verify) is not a prefill

    def _model_and_mtp(self, batch: PackedBatch, row_ids: torch.Tensor | None, prefill_seq: SequenceState | None,
                       decode_seqs: list[SequenceState]) -> torch.Tensor:
        if not (self.mtp_keep_up and self.model.has_mtp_head):
            return self.model(batch, self.pools.kv_store, self.pools.ssm, row_ids)
        logits, hidden = self.model(batch, self.pools.kv_store, self.pools.ssm, row_ids, return_hidden=True)
        mtp_feed.keep_up(self.model, self.pools.kv_store, self.kv_block_size, batch, hidden, prefill_seq, decode_seqs)
        return logits

    # ---- drafts (speculative decoding) ---------------------------------------------------------
    def mtp_draft(self, seq: SequenceState, token: int, num_drafts: int) -> list[int]:
        """Greedy MTP drafts after ``token``; the blocks up to cached + num_drafts must be allocated."""
        return mtp_feed.draft(self.model, self.pools.kv_store, self.kv_block_size, seq, token, num_drafts)

    def mtp_keep_up_segment(self, seq: SequenceState, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        """MTP rows for a kept verify segment (``tokens`` at positions start.., main hidden [n, H])."""
        mtp_feed.keep_up_segment(self.model, self.pools.kv_store, self.kv_block_size, seq, tokens, start, hidden)

    @torch.inference_mode()
    def self_draft(self, seq: SequenceState, token: int, num_drafts: int, num_layers: int) -> list[int]:
        """Greedy drafts from the first ``num_layers`` layers (early exit), one token at a time.

        The draft rows write those layers' K/V at positions cached.. (the verify rewrites them)
        and advance their SSM state, which is put back afterwards. The blocks up to
        cached + num_drafts must be allocated.
        """
        snapshot = self.pools.ssm.snapshot(self._slot(seq))
        drafts: list[int] = []
        try:
            for step in range(num_drafts):
                batch = build_batch(None, [(token, seq.num_cached_tokens + step, seq.block_table, seq.ssm_slot)],
                                    self.kv_block_size, self.device)
                shift_past_prompt(batch, seq)
                logits = self.model(batch, self.pools.kv_store, self.pools.ssm, exit_after=num_layers)  # [1, V]
                token = int(logits[0].argmax())
                drafts.append(token)
        finally:
            self.pools.ssm.restore(snapshot, seq.ssm_slot)
        return drafts

    def _capture_snapshot(self, capture: SSMCapture, seq: SequenceState) -> SSMSnapshot:
        """Stack the per-layer captured states into the pool's snapshot layout."""
        slot = self._slot(seq)
        conv = torch.zeros_like(self.pools.ssm.conv[:, slot])  # [L, conv_dim, K-1]
        recurrent = torch.zeros_like(self.pools.ssm.recurrent[:, slot])  # [L, Hv, Dk, Dv]
        for index, state in capture.conv.items():
            conv[index] = state
        for index, state in capture.recurrent.items():
            recurrent[index] = state
        return SSMSnapshot(conv, recurrent)

    def _check_chunk(self, seq: SequenceState, prompt, offset: int, length: int) -> list[int]:
        if not prompt:
            raise ValueError("prompt is empty")
        if length < 1 or offset < 0 or offset + length > len(prompt):
            raise ValueError(f"chunk offset={offset} length={length} outside prompt of {len(prompt)} tokens")
        if offset != seq.num_cached_tokens:
            raise ValueError(f"request {seq.request_id}: chunk offset {offset} != cached tokens "
                             f"{seq.num_cached_tokens}")
        self._slot(seq)
        chunk = list(prompt[offset: offset + length])
        self._check_tokens(chunk, "prompt")
        return chunk

    def _check_tokens(self, tokens: list[int], field: str) -> None:
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{field}: token id(s) {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")

    def _slot(self, seq: SequenceState) -> int:
        if seq.ssm_slot is None:
            raise ValueError(f"request {seq.request_id} has no SSM slot: call admit() first")
        return seq.ssm_slot
