"""The roofline of a forward: the least time this machine could take for it.

A forward must do its FLOPs (at best at the rate of a large square GEMM) and must move its
bytes (at best at the read bandwidth of a streaming pass): its roofline is the larger of the
two times. ``forward_cost`` is the pure cost model (FLOPs and bytes from the config and the
batch shape); ``measure_rates`` times the two rates on this machine with the current threads
(the GEMM in the given dtype, the fastest of the libraries torch offers), and ``RateProbe`` samples
them one at a time, to interleave with forwards. ``bench/forward.py`` and the engine's per-tick
telemetry both use them, so the dashboard's share and the benchmark's share mean the same thing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.model.config import ModelConfig

FP32_BYTES = 4  # linear-attention state and conv state stay float32 in any dtype


@dataclass(frozen=True)
class ForwardCost:
    flops: float
    bytes: float

    def __add__(self, other: "ForwardCost") -> "ForwardCost":
        return ForwardCost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class MachineRates:
    flops_per_s: float  # square-GEMM rate: the fastest library's
    bytes_per_s: float  # streaming read bandwidth
    gemm: str = ""  # the GEMM that rate came from ('mm': torch.mm, 'onednn': a prepacked weight), where known

    def seconds(self, cost: ForwardCost) -> float:
        """The roofline time of ``cost``: compute-bound or bandwidth-bound, whichever is longer."""
        return max(cost.flops / self.flops_per_s, cost.bytes / self.bytes_per_s)


def gemm_params(config: ModelConfig) -> tuple[int, int]:
    """(body GEMM weights per token, LM-head weights): every projection a token goes through."""
    if getattr(config, "latent_dim", None):
        return _kimi_gemm_params(config), config.vocab_size * config.hidden_size
    h = config.hidden_size
    attn = h * config.num_attention_heads * config.head_dim * 2  # q and its output gate
    attn += 2 * h * config.num_key_value_heads * config.head_dim  # k, v
    attn += config.num_attention_heads * config.head_dim * h  # o
    gdn = h * (config.conv_dim + config.linear_value_dim + 2 * config.linear_num_value_heads)
    gdn += config.linear_value_dim * h
    body = (len(config.full_attention_layers) * attn + len(config.linear_attention_layers) * gdn
            + config.num_hidden_layers * _mlp_params(config))
    return body, config.vocab_size * h


def _mlp_params(config: ModelConfig) -> int:
    """One Qwen3.5 layer's MLP weights a token goes through: the dense SwiGLU, or for Qwen3.5-MoE the
    router, its top-k experts, the shared expert and the shared expert's gate."""
    h = config.hidden_size
    if not config.is_moe:
        return 3 * h * config.intermediate_size
    experts = 3 * h * config.moe_intermediate_size * config.num_experts_per_tok
    return h * config.num_experts + experts + 3 * h * config.shared_expert_intermediate_size + h


def last_mlp_params(config: ModelConfig) -> int:
    """The part of ``gemm_params``' body that only the logits rows run: Qwen3.5's last layer drops the
    other rows before its MLP (``Qwen35ForCausalLM.forward``'s ``keep_rows``), so a 512-token prefill
    runs that MLP for 1 row, not 512. Kimi Linear runs every row through every layer (0)."""
    return 0 if getattr(config, "latent_dim", None) else _mlp_params(config)


def gemm_flops(config: ModelConfig, tokens: int, logits_rows: int) -> int:
    """The projections' and the LM head's FLOPs of a forward over ``tokens`` rows, ``logits_rows`` of them
    with logits: 2 per multiply-add."""
    body, head = gemm_params(config)
    last_mlp = last_mlp_params(config)
    return 2 * (body - last_mlp) * tokens + 2 * (last_mlp + head) * logits_rows


def _kimi_gemm_params(config) -> int:
    """Kimi Linear's body: MLA and KDA projections, dense MLPs, and the experts a token runs (top-k + shared)."""
    h, heads = config.hidden_size, config.num_attention_heads
    mla = h * heads * config.qk_head_dim + h * config.latent_dim + config.kv_lora_rank * heads * (
        config.qk_nope_head_dim + config.v_head_dim) + heads * config.v_head_dim * h
    width, dim = config.linear_key_dim, config.linear_head_dim
    kda = h * (config.conv_dim + 2 * dim + config.linear_num_heads) + 2 * dim * width + width * h
    dense = 3 * h * config.intermediate_size
    sparse = 3 * h * config.moe_intermediate_size * (config.num_experts_per_tok + config.num_shared_experts)
    sparse += h * config.num_experts  # the router
    mlps = sum(dense if kind == "dense" else sparse for kind in config.mlp_layer_types)
    return len(config.full_attention_layers) * mla + len(config.linear_attention_layers) * kda + mlps


def _attention_widths(config) -> tuple[int, int]:
    """(cached values per token and attention layer, query width): per-head K/V, or an MLA latent row."""
    if getattr(config, "latent_dim", None):
        # Scores over qk dims and the weighted sum over v dims per head: 4 * width FLOPs per key.
        return config.latent_dim, config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) // 2
    return 2 * config.num_key_value_heads * config.head_dim, config.num_attention_heads * config.head_dim


def _ssm_state_bytes(config: ModelConfig) -> int:
    """One sequence's linear-attention state (recurrent + conv window), all layers, float32."""
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    conv = config.conv_dim * (config.linear_conv_kernel_dim - 1)
    return len(config.linear_attention_layers) * (recurrent + conv) * FP32_BYTES


def forward_cost(config: ModelConfig, weight_bytes: int, prefill_tokens: int, prefill_start: int,
                 decode_contexts: list[int], logits_rows: int) -> ForwardCost:
    """FLOPs and bytes of one forward over a prefill chunk and decode rows.

    ``weight_bytes``: bytes per weight element (each weight is read once per forward);
    ``prefill_start``: tokens cached before the chunk; ``decode_contexts``: each decode row's
    context length, its own token included; ``logits_rows``: the rows whose logits it computes (the
    last layer's MLP and the LM head run those alone). K/V are read once per row and written once per
    token; each sequence's linear-attention state is read and written once.

    It is a lower bound on the work, so a share of the roofline cannot pass 100% by counting: FLOPs
    the forward may skip are not counted (a tied embedding's lookup is no GEMM; only the logits rows'
    LM head; tests/engine/model/test_roofline.py checks it against torch's FLOP counter on a real forward).
    """
    body, head = gemm_params(config)
    last_mlp = last_mlp_params(config)  # run by the logits rows only, its weights read only if there are any
    tokens = prefill_tokens + len(decode_contexts)
    full_layers = len(config.full_attention_layers)
    kv_width, q_width = _attention_widths(config)  # cached values per token per layer, query width
    # Attention: QK^T and PV, 2 FLOPs per multiply-add each, over the visible keys.
    prefill_keys = prefill_tokens * prefill_start + prefill_tokens * (prefill_tokens + 1) // 2
    visible = prefill_keys + sum(decode_contexts)
    attn_flops = 4 * q_width * visible * full_layers
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    gdn_flops = 6 * recurrent * len(config.linear_attention_layers) * tokens  # decay, update, read-out
    flops = gemm_flops(config, tokens, logits_rows) + attn_flops + gdn_flops
    sequences = (1 if prefill_tokens else 0) + len(decode_contexts)
    kv_read = (prefill_start + sum(decode_contexts)) * kv_width * full_layers * weight_bytes
    kv_write = tokens * kv_width * full_layers * weight_bytes
    state = 2 * sequences * _ssm_state_bytes(config)
    moved = (body - last_mlp + (last_mlp + head if logits_rows else 0)) * weight_bytes + kv_read + kv_write + state
    return ForwardCost(float(flops), float(moved))


class RateProbe:
    """Samples this machine's two rates, one square GEMM per library and one read pass per ``sample()``.

    Sized once (GEMM operands in ``dtype``, a float32 read buffer of ``stream_mib``), so a
    sample costs a few GEMMs and one read pass (~50 ms on a Zen 3 core) and can be interleaved
    with the forwards it judges: load on a shared machine then reaches both alike.

    The compute rate is the fastest of the square GEMMs torch offers for ``dtype`` (``square_gemms``):
    MKL's (``torch.mm``) and oneDNN's on a prepacked weight. One library is not the ceiling: on an
    AMD EPYC Zen 5 (full-width AVX-512) MKL's fp32 GEMM takes its AVX2 path, ~100 GFLOP/s on one
    core, while oneDNN's reaches ~250 and the native AVX-512 decode GEMMs ~200; a roofline at MKL's
    rate put smol's fp32 decode b32 at 152% of it.

    The GEMM grows from 256 up to ``gemm_size`` while one sample's GEMMs stay under ``max_gemm_s``:
    where ``dtype`` has no fast kernel (bf16 on a CPU without AVX512-BF16 / AMX runs ~100x
    slower than fp32) a 1024 GEMM would take seconds and the engine's start would wait on it.
    The read pass sums a float32 buffer larger than any cache: bandwidth is bytes whatever
    their dtype, and a bf16 sum on such a CPU would time conversions, not memory.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, gemm_size: int = 1024, stream_mib: int = 256,
                 clock=time.perf_counter, max_gemm_s: float = 0.05):
        self.clock = clock
        size = 256
        while True:
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            self.gemms = square_gemms(a, b)
            first = sum(_timed(gemm, clock) for gemm in self.gemms.values())  # the first calls also pick kernels
            again = sum(_timed(gemm, clock) for gemm in self.gemms.values())
            if size * 2 > gemm_size or min(first, again) * 8 > max_gemm_s:  # the next size costs 8x
                break
            size *= 2
        self.gemm_flops = 2 * size ** 3
        self.buffer = torch.ones(stream_mib * (1 << 20) // 4, dtype=torch.float32)
        self.buffer.sum()

    def sample(self) -> MachineRates:
        """Each library's GEMM and one read pass, timed with the probe's clock; the fastest GEMM's rate."""
        gemm_s = {name: _timed(gemm, self.clock) for name, gemm in self.gemms.items()}
        fastest = min(gemm_s, key=gemm_s.get)
        read = _timed(self.buffer.sum, self.clock)
        return MachineRates(self.gemm_flops / gemm_s[fastest], self.buffer.numel() * self.buffer.element_size() / read,
                            gemm=fastest)


def square_gemms(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    """``a @ b`` through each CPU GEMM torch offers for their dtype, by name: 'mm' (``torch.mm``: MKL's sgemm
    in fp32, oneDNN in bf16) and 'onednn' (oneDNN on a prepacked weight, as the engine's prefill and decode
    GEMMs run it) where oneDNN multiplies that dtype natively (fp32; bf16 with AVX512-BF16 / AMX)."""
    gemms: dict[str, Callable[[], object]] = {"mm": lambda: a @ b}
    if (a.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (a.dtype == torch.float32
                 or (a.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))):
        weight = b.t().contiguous()  # [out, in] as a linear layer holds it: a @ weight^T == a @ b
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, a.shape[0])
        gemms["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    return gemms


def best_rates(samples: list[MachineRates]) -> MachineRates:
    """The fastest of each rate over ``samples``: the machine's ceiling as far as they saw it."""
    fastest = max(samples, key=lambda r: r.flops_per_s)
    return MachineRates(fastest.flops_per_s, max(r.bytes_per_s for r in samples), fastest.gemm)


def measure_rates(dtype: torch.dtype = torch.float32, gemm_size: int = 1024, stream_mib: int = 256,
                  repeats: int = 3, clock=time.perf_counter, max_gemm_s: float = 0.05) -> MachineRates:
    """Best-of-``repeats`` square-GEMM FLOP/s in ``dtype`` and streaming read bytes/s, with the current threads."""
    probe = RateProbe(dtype, gemm_size, stream_mib, clock, max_gemm_s)
    return best_rates([probe.sample() for _ in range(repeats)])


def _timed(fn, clock) -> float:
    start = clock()
    fn()
    return clock() - start
