"""The Qwen3.5 vision tower: image patches in, one text-width embedding per merged 2x2 patch block out.

Math follows transformers' ``Qwen3_5VisionModel`` (HF parameter names, so checkpoints load as
they are): a patch embedding (a Conv3d whose stride equals its kernel, i.e. one linear map per
flattened patch), the learned square position grid resampled bilinearly (corners aligned) to the
image's patch grid, blocks of LayerNorm -> attention with a 2-D rotary over the whole head
(half the frequencies follow the patch row, half its column) -> LayerNorm -> GELU MLP, and the
merger that concatenates each spatial-merge block's patches and projects them to the text width.

Patches arrive in merge-block order (``engine/multimodal/preprocess.py`` lays them out so), which
is the order the merger needs; attention never crosses images because the tower runs per image.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.vision_config import VisionConfig


def gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if kind == "gelu_pytorch_tanh" else "none")


def block_order(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column [h * w] of each patch in merge-block order (block row, block col, in-row, in-col)."""
    rows = torch.arange(grid_h).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
    cols = torch.arange(grid_w).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
    # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: the patches of one merge block become adjacent.
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C * T * P * P] -> [N, hidden]: a kernel-sized stride makes the conv one GEMM."""
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)  # [hidden, C * T * P * P]
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] (one image's patches, all visible to each other); cos / sin [N, 1, head_dim]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D] each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None])  # [1, H, N, D]
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the whole head, in float32 as transformers does: x [N, H, D]."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.act = config.hidden_act
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(gelu(self.linear_fc1(x), self.act))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's patches side by side -> GELU MLP -> text width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged = config.hidden_size * config.merge_unit
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] in merge-block order -> [N / merge_unit, out_hidden]."""
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        spatial = config.head_dim // 2
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image: patches [t * h * w, patch_dim] in merge-block order, grid (t, h, w) in patches
        -> embeddings [t * h * w / merge_unit, out_hidden], one per placeholder token."""
        t, h, w = grid
        rows, cols = block_order(h, w, self.config.spatial_merge_size)  # [h * w] each
        rows, cols = rows.repeat(t).to(patches.device), cols.repeat(t).to(patches.device)
        x = self.patch_embed(patches)  # [N, hidden]
        x = x + self.position_grid(h, w).index_select(0, rows * w + cols).to(x.dtype)
        cos, sin = self.rotary(rows, cols)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)

    def position_grid(self, h: int, w: int) -> torch.Tensor:
        """The learned side x side grid resampled to h x w (bilinear, corners aligned): [h * w, hidden]
        in raster order."""
        side = self.config.grid_side
        table = self.pos_embed.weight.float().t().reshape(1, -1, side, side)  # [1, hidden, side, side]
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)  # [1, hidden, h, w]
        return grid[0].reshape(grid.shape[1], h * w).t()

    def rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [N, 1, head_dim]: row frequencies then column frequencies, the pair repeated."""
        inv_freq = self.inv_freq.to(rows.device)
        freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [N, 1, head_dim]
        return freqs.cos(), freqs.sin()


def attach_vision(model: nn.Module, config: VisionConfig) -> None:
    """Give a Qwen3.5 (dense or MoE) text model its vision tower and the interleaved M-RoPE.

    Text-only forwards are unchanged: with one position on all axes M-RoPE is the plain rotary.
    Decode stays eager: a prompt with images shifts its decode positions by a per-request delta
    the compiled step does not take.
    """
    from engine.model.mrope import InterleavedMRoPE

    model.visual = VisionTower(config)
    model.vision_config = config
    model.rotary = InterleavedMRoPE(model.config.rotary_dim, model.config.rope_theta, config.mrope_section)
    model.supports_compiled_decode = False
