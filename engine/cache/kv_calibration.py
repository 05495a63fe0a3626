"""InnerQ calibration: per-channel key normalization, computed once from the first prefills.

A few channels of the keys carry most of their magnitude; a group of channels that holds
one of them gets a step too coarse for its other channels. Dividing every stored key by a
per-channel scale ``s`` (per KV head and channel, from the RMS of the calibration keys)
evens the channels out before grouping, and multiplying the query by the same ``s`` keeps
every dot product exact: ``q . k = (q * s) . (k / s)``. The scale is folded into the query
(one multiply per new query row), so no cached key is ever rescaled when it is read.

States, moved only by ``poll`` (called where the reference calls ``poll_innerq``: at the
start of every prefill chunk):

    calibrating --(calib_tokens prefill keys seen)--> ready --(next poll)--> applied

``ready`` means the scales are computed; ``applied`` means they are in use: keys written
from then on are normalized and their blocks may be quantized, keys written earlier are
normalized in place once (they stay full precision until their sequence ends).
"""
from __future__ import annotations

import torch

STATE_OFF = "off"              # --kv-cache-dtype auto: nothing to calibrate
STATE_CALIBRATING = "calibrating"
STATE_READY = "ready"
STATE_APPLIED = "applied"
STATES = (STATE_OFF, STATE_CALIBRATING, STATE_READY, STATE_APPLIED)
SCALE_RANGE = (1e-2, 1e2)      # a dead channel must not blow the query up


def next_state(state: str, tokens_seen: int, calib_tokens: int) -> str:
    """The state after one poll (pure)."""
    if state == STATE_CALIBRATING and tokens_seen >= calib_tokens:
        return STATE_READY
    if state == STATE_READY:
        return STATE_APPLIED
    return state


def channel_scales(sum_sq: torch.Tensor, count: int) -> torch.Tensor:
    """[Hkv, D] sums of squared keys over ``count`` tokens -> per-channel scales [Hkv, D],
    each head's scales divided by their mean so normalized keys keep their overall size."""
    rms = (sum_sq / max(count, 1)).sqrt()
    rms = rms / rms.mean(dim=-1, keepdim=True).clamp_min(1e-12)
    return rms.clamp(*SCALE_RANGE).float()


class KeyCalibration:
    """Running key statistics per attention layer, and the state the poll moves."""

    def __init__(self, layer_ids: list[int], num_kv_heads: int, head_dim: int, calib_tokens: int,
                 device: torch.device | str = "cpu"):
        self.calib_tokens = calib_tokens
        self.state = STATE_CALIBRATING
        self._sum_sq = {i: torch.zeros(num_kv_heads, head_dim, dtype=torch.float64, device=device)
                        for i in layer_ids}
        self._count = {i: 0 for i in layer_ids}
        self.scales: dict[int, torch.Tensor] | None = None   # [Hkv, D] per layer once ready

    @property
    def tokens_seen(self) -> int:
        """Tokens every layer has seen (a forward that raised midway counts for no layer short of it)."""
        return min(self._count.values()) if self._count else 0

    def observe(self, layer_id: int, keys: torch.Tensor) -> None:
        """keys: [T, Hkv, D] post-rotary keys of prefill rows, before any normalization."""
        if self.state != STATE_CALIBRATING or keys.shape[0] == 0 or layer_id not in self._count:
            return
        self._sum_sq[layer_id] += keys.double().square().sum(dim=0)
        self._count[layer_id] += int(keys.shape[0])

    def poll(self) -> tuple[str, str] | None:
        """Advance one step; (old, new) when the state changed, else None.

        Entering ``ready`` computes the scales; the caller applies them on ``applied``."""
        new = next_state(self.state, self.tokens_seen, self.calib_tokens)
        if new == self.state:
            return None
        if new == STATE_READY:
            self.scales = {i: channel_scales(s, self._count[i]) for i, s in self._sum_sq.items()}
        old, self.state = self.state, new
        return old, new

    def describe(self) -> dict:
        detail = {"tokens_seen": self.tokens_seen, "calib_tokens": self.calib_tokens}
        if self.scales:
            stacked = torch.stack(list(self.scales.values()))
            detail.update(scale_min=round(float(stacked.min()), 4), scale_max=round(float(stacked.max()), 4))
        return detail
