"""What a tick's forwards left for sampling and accounting (the value ``execute`` returns)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.scheduler.request import Request
from telemetry import events as ev


@dataclass
class TickOutput:
    row: ev.ChunkDecision | None = None          # a chunk tick's decision row, emitted when accounted
    chunk_start_ns: int = 0
    chunk_ran: bool = False                      # the chunk's forward computed (fused or plain)
    prefill_logits: torch.Tensor | None = None   # [V] at a last chunk's end: token 0
    decode_batch: list[Request] = field(default_factory=list)   # the rows ``decode_logits`` belong to
    decode_logits: torch.Tensor | None = None    # [B, V]
    spec: Any = None                             # engine.spec.spec_step.SpecForward: a verify forward
    batch_at_start: list[Request] = field(default_factory=list)   # a decode tick's batch (a failure ends it)
    failed: bool = False                         # a decode tick's forward raised (its batch ended)
    num_decode: int = 0                          # decode tokens computed (the tick row)
