"""Kimi Linear's sparse MLP: a sigmoid router with grouped top-k, the Qwen3.5-MoE experts, shared experts.

Routing follows transformers' ``KimiLinearTopkRouter`` (DeepSeek-V3's): scores are the sigmoid of
the router logits (float32); a per-expert score-correction bias is added only to *choose* experts:
the groups with the best top-2 sums are kept (``topk_group`` of ``n_group``), the top-k experts
inside them chosen, and their uncorrected scores renormalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``. The routed experts are ``qwen3_5_moe.Experts`` (grouped by expert,
expert-parallel through the same exchange, summed in one fixed order); the shared experts are one
SwiGLU of ``moe_intermediate_size * num_shared_experts`` added unscaled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import SwiGLU
from engine.model.qwen3_5_moe import Experts, ForwardTimings, LocalExchange

NORM_EPS = 1e-20  # the reference's guard on the renormalising sum


class TopkRouter(nn.Module):
    """``gate.weight`` [E, H] and ``gate.e_score_correction_bias`` [E] (a buffer, as in the checkpoint)."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.num_groups, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = self.num_experts // self.num_groups
        group_scores = choice.view(-1, self.num_groups, per_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()  # [T, G]
        keep = keep[:, :, None].expand(-1, self.num_groups, per_group).reshape(-1, self.num_experts)
        top_idx = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        top_w = scores.gather(1, top_idx)
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + NORM_EPS)
        return top_w * self.scaling, top_idx


class KimiMoeBlock(nn.Module):
    """Router + routed experts + shared experts (HF names: gate, experts, shared_experts)."""

    def __init__(self, config, bounds: list[tuple[int, int]], rank: int, timings: ForwardTimings):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = Experts(config, *bounds[rank])
        self.shared_experts = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
        self.bounds, self.timings = bounds, timings
        self.exchange = LocalExchange()

    def fuse(self) -> None:
        self.shared_experts.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        top_w, top_idx = self.gate(x)
        routed = self.experts(x, top_idx, top_w.to(x.dtype), self.exchange, self.bounds, self.timings)
        return routed + self.shared_experts(x)
