"""M-RoPE: the text rotary of a Qwen3.5 prompt with images, three position axes (t, h, w) interleaved.

Text tokens carry the same position on all three axes (so a text-only prompt is the plain rotary).
An image's placeholder tokens, a (h, w) grid of merged patches, sit at (start, start + row,
start + col) where ``start`` is the next text position; the text after the image continues at
``start + max(h, w)``. So a prompt with images ends at a position below its length: every later
token sits at its index plus ``delta`` (negative), which is all decode needs.

The rotary's frequencies are shared out between the axes interleaved: frequency i follows h when
i % 3 == 1 and i < 3 * sections[1], w when i % 3 == 2 and i < 3 * sections[2], t otherwise
(transformers' ``Qwen3_5TextRotaryEmbedding.recomposition_frequencies``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.layers import PartialRotary


def prompt_positions(num_tokens: int, images: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (long) and the delta of every token after the prompt.

    ``images``: (first placeholder index, merged grid rows, merged grid cols) per image, in
    prompt order and not overlapping; each image has rows * cols placeholder tokens.
    """
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    index, next_position = 0, 0
    for start, rows, cols in images:
        text = start - index  # text tokens before this image
        positions[:, index:start] = torch.arange(next_position, next_position + text)
        next_position += text
        end = start + rows * cols
        positions[0, start:end] = next_position
        positions[1, start:end] = (torch.arange(rows) + next_position).repeat_interleave(cols)
        positions[2, start:end] = (torch.arange(cols) + next_position).repeat(rows)
        next_position += max(rows, cols)
        index = end
    positions[:, index:] = torch.arange(next_position, next_position + num_tokens - index)
    last = next_position + num_tokens - index  # the position the first token after the prompt takes
    return positions, last - num_tokens


class InterleavedMRoPE(PartialRotary):
    """``PartialRotary`` that also takes positions [3, T] (t, h, w) and interleaves their frequencies."""

    def __init__(self, rotary_dim: int, theta: float, sections: Sequence[int]):
        super().__init__(rotary_dim, theta)
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long)  # which position axis each frequency follows
        for dim in (1, 2):
            axis[dim: 3 * sections[dim]: 3] = dim
        self.axis = axis

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        if self.inv_freq.device != positions.device:
            self.inv_freq, self.axis = self.inv_freq.to(positions.device), self.axis.to(positions.device)
        # [3, T, F] per-axis angles, then each frequency's angle from its own axis: [T, 1, F].
        angles = positions.float()[:, :, None] * self.inv_freq
        freqs = angles.gather(0, self.axis.expand(1, positions.shape[1], -1))[0][:, None, :]
        sin = freqs.sin()
        return torch.cat([freqs, freqs], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)
