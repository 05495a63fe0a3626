"""Qwen3.5-MoE (text): the hybrid decoder with a sparse mixture-of-experts block as every layer's MLP.

Routing follows transformers' ``Qwen3_5MoeSparseMoeBlock``: softmax over the router logits
(float32), top-k, renormalized to sum 1; a shared expert scaled by ``sigmoid(shared_expert_gate)``
is added to the routed sum. Experts are stored as 3-D tensors (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]); checkpoints written by transformers' ``save_pretrained`` hold them per
expert (``experts.{e}.gate_proj.weight`` ...), which ``read_checkpoint_tensor`` stacks.

Under expert parallelism each rank holds the experts ``[first, end)`` of an equal split; every
rank sees every token, computes its own experts' rows and the ``ExpertExchange`` hands each rank
every expert's rows, which are summed in one fixed order, so any world size gives the same bits.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ConfigError, ModelConfig
from engine.model.errors import RankFailure
from engine.model.layers import SwiGLU
from engine.model.qwen3_5 import Qwen35ForCausalLM


def shard_bounds(num_experts: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's expert range [first, end); the world size must divide the experts."""
    if world_size < 1:
        raise ConfigError(f"expert-parallel world size must be >= 1, got {world_size}")
    if num_experts % world_size:
        raise ConfigError(f"expert parallelism over {world_size} ranks needs a number of experts divisible "
                          f"by {world_size}; the checkpoint has {num_experts}")
    per_rank = num_experts // world_size
    return [(r * per_rank, (r + 1) * per_rank) for r in range(world_size)]


class ForwardTimings:
    """What one forward's MoE blocks spent, summed over layers (ns): own experts and exchange."""

    def __init__(self):
        self.expert_ns = 0
        self.exchange_ns = 0

    def reset(self) -> None:
        self.expert_ns = self.exchange_ns = 0


def sum_rows(tokens: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Add each row of ``rows`` [N, H] into its token's row of a zero [num_tokens, H], in row order.

    Every exchange ends here with the rows of a token in global expert order, so the sum is
    the same float operations whatever the world size.
    """
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add_(0, tokens, rows)


class LocalExchange:
    """One rank holds every expert: nothing to exchange."""

    world_size = 1

    def combine(self, local: torch.Tensor, tokens: torch.Tensor, runs: list[tuple[int, int]],
                num_tokens: int) -> torch.Tensor:
        """local [N, H]: this rank's rows of the assignments ``runs[rank]``; -> the routed sum [T, H]."""
        return sum_rows(tokens, local, num_tokens)


class Experts(nn.Module):
    """The experts ``[first, end)`` of one rank, computed grouped by expert (one GEMM pair per active expert)."""

    def __init__(self, config: ModelConfig, first: int, end: int):
        super().__init__()
        self.first, self.end = first, end
        self.num_experts = config.num_experts
        local, hidden, inter = end - first, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(local, 2 * inter, hidden))  # [E_local, 2I, H]
        self.down_proj = nn.Parameter(torch.zeros(local, hidden, inter))  # [E_local, H, I]

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, exchange,
                bounds: list[tuple[int, int]], timings: ForwardTimings) -> torch.Tensor:
        """x [T, H], top_idx / top_w [T, k] -> the weighted routed sum [T, H].

        Assignments (token, slot) are sorted by expert (stable, so token order within an
        expert); rank r's experts own one contiguous run of that order. Each rank computes its
        run; the exchange brings each token's rows together and sums them in expert order (the
        order transformers' loop adds them in), one ``index_add_`` whatever the world size.
        """
        start_ns = time.perf_counter_ns()
        k = top_idx.shape[1]
        flat = top_idx.reshape(-1)  # [T*k] expert of each assignment
        order = torch.argsort(flat, stable=True)  # [T*k] assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        weights = top_w.reshape(-1)  # [T*k]
        pieces = []
        for expert in range(self.first, self.end):
            lo, hi = starts[expert], starts[expert + 1]
            if lo == hi:
                continue
            assignment = order[lo:hi]  # [n]
            rows = x.index_select(0, assignment // k)  # [n, H]
            gate, up = F.linear(rows, self.gate_up_proj[expert - self.first]).chunk(2, dim=-1)  # [n, I] each
            out = F.linear(F.silu(gate) * up, self.down_proj[expert - self.first])  # [n, H]
            pieces.append(out * weights.index_select(0, assignment)[:, None])
        local = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])  # [N_local, H]
        exchange_start = time.perf_counter_ns()
        timings.expert_ns += exchange_start - start_ns
        runs = [(starts[first], starts[end]) for first, end in bounds]  # each rank's slice of ``order``
        combined = exchange.combine(local, order // k, runs, x.shape[0])  # [T, H]
        timings.exchange_ns += time.perf_counter_ns() - exchange_start
        return combined


class SparseMoeBlock(nn.Module):
    """Router + routed experts + gated shared expert (HF names: gate, experts, shared_expert, shared_expert_gate)."""

    def __init__(self, config: ModelConfig, bounds: list[tuple[int, int]], rank: int, timings: ForwardTimings):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # router [E, H]
        self.experts = Experts(config, *bounds[rank])
        self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.bounds = bounds
        self.timings = timings
        self.exchange = LocalExchange()

    def fuse(self) -> None:
        self.shared_expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        router_logits = F.linear(x, self.gate.weight)  # [T, E]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(router_logits.dtype)
        routed = self.experts(x, top_idx, top_w, self.exchange, self.bounds, self.timings)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    """The MoE model; ``ep_rank`` / ``ep_size`` choose which experts this process holds."""

    # Expert routing picks rows by value (which experts each token chose): decode stays eager.
    supports_compiled_decode = False
    # A checkpoint's per-expert tensor names for each 3-D expert tensor (``read_checkpoint_tensor``).
    per_expert_names = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

    def __init__(self, config: ModelConfig, ep_rank: int = 0, ep_size: int = 1):
        if not config.is_moe:
            raise ConfigError(f"{type(self).__name__} needs a config with num_experts > 0")
        bounds = shard_bounds(config.num_experts, ep_size)
        if not 0 <= ep_rank < ep_size:
            raise ConfigError(f"expert-parallel rank {ep_rank} outside world size {ep_size}")
        timings = ForwardTimings()
        super().__init__(config, make_mlp=lambda cfg, layer: self.make_moe_block(cfg, layer, bounds, ep_rank, timings))
        self.ep_rank, self.ep_size, self.expert_bounds, self.moe_timings = ep_rank, ep_size, bounds, timings
        # Rank 0 under expert parallelism: broadcasts each forward's inputs first (engine/distributed/leader.py).
        self.leader = None
        self.clock_ns: Callable[[], int] = time.monotonic_ns  # run-relative once telemetry is attached

    @staticmethod
    def make_moe_block(config, layer_id: int, bounds: list[tuple[int, int]], rank: int,
                       timings: ForwardTimings) -> nn.Module:
        """Layer ``layer_id``'s MLP: every Qwen3.5-MoE layer has the sparse block."""
        return SparseMoeBlock(config, bounds, rank, timings)

    @property
    def last_broadcast_ns(self) -> int | None:
        return self.leader.last_broadcast_ns if self.leader is not None else None

    @property
    def last_vision_sync_ns(self) -> int | None:
        return self.leader.last_vision_sync_ns if self.leader is not None else None

    def forward(self, batch, kv, pool, logits_rows: torch.Tensor | None = None, *, return_hidden: bool = False,
                exit_after: int | None = None):
        """As the dense model; with a leader attached, every rank runs this forward together.

        ``return_hidden`` only changes what rank 0 returns (the ranks run the same layers);
        ``exit_after`` would have the ranks run different layers, so it never comes with a leader
        (``has_self_draft`` is False under expert parallelism).
        """
        if self.leader is None:
            return super().forward(batch, kv, pool, logits_rows, return_hidden=return_hidden, exit_after=exit_after)
        if exit_after is not None:
            raise RankFailure("an early-exit forward under expert parallelism would leave the ranks out of step")
        self.leader.before_forward(batch, logits_rows, pool)
        self.moe_timings.reset()
        start_ns, start = self.clock_ns(), time.perf_counter_ns()
        try:
            logits = super().forward(batch, kv, pool, logits_rows, return_hidden=return_hidden)
        except Exception as err:
            if isinstance(err, RankFailure):
                raise
            # The other ranks are inside this forward's collectives: the ranks are out of step for good.
            raise RankFailure(f"expert-parallel forward failed on rank 0 after its broadcast, so the ranks "
                              f"are out of step ({type(err).__name__}: {err})") from err
        self.leader.after_forward(start_ns, self.moe_timings.expert_ns, self.moe_timings.exchange_ns,
                                  time.perf_counter_ns() - start)
        return logits

    @property
    def is_ep(self) -> bool:
        return self.ep_size > 1

    @property
    def has_self_draft(self) -> bool:
        """Early-exit drafts run fewer layers on rank 0 alone: not under expert parallelism."""
        return super().has_self_draft and not self.is_ep

    def attach_exchange(self, exchange) -> None:
        """Route every MoE block's expert rows through ``exchange`` (see ``LocalExchange.combine``)."""
        for layer in self.model.layers:
            if hasattr(layer.mlp, "exchange"):  # sparse blocks only (Kimi Linear has dense ones too)
                layer.mlp.exchange = exchange

    def read_checkpoint_tensor(self, stored_name: str, read: Callable[[str], torch.Tensor | None]):
        """This rank's slice of a 3-D expert tensor, from the 3-D layout or stacked per-expert weights.

        Returns None for any other tensor (the loader reads it as stored).
        """
        for kind in ("gate_up_proj", "down_proj"):
            if stored_name.endswith(f".experts.{kind}"):
                break
        else:
            return None
        first, end = self.expert_bounds[self.ep_rank]
        fused = read(stored_name)
        if fused is not None:
            if fused.dim() != 3 or fused.shape[0] != self.config.num_experts:
                raise ConfigError(f"tensor {stored_name} has shape {tuple(fused.shape)}, expected "
                                  f"{self.config.num_experts} experts in dim 0")
            return fused[first:end]
        base = stored_name[: -len(kind)]
        per_expert = []
        for expert in range(first, end):
            names = [f"{base}{expert}.{part}.weight" for part in self.per_expert_names[kind]]
            parts = [read(name) for name in names]
            if any(part is None for part in parts):
                return None  # the loader reports the 3-D name as missing
            per_expert.append(torch.cat(parts, dim=0))  # [2I, H] or [H, I]
        return torch.stack(per_expert)
