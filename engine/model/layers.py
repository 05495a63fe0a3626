"""Building blocks shared by the Qwen3.5 layers: SwiGLU MLP, partial rotary embedding, prepacked linears
(the norms are in ``norms.py``)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import custom_ops, skinny_gemm
from engine.model import reproducible
from engine.model.gate_up import GateUpSiLU


# Rows from which a oneDNN-prepacked weight beats MKL's sgemm (measured in the smol prefill on an
# AVX2 CPU, float32, 1 thread): ~9% faster at 512 rows, even at 300, a loss at 100 once padded.
PACKED_MIN_ROWS = 128

# Weights smaller than this (elements) stay on MKL: oneDNN's per-call overhead loses on short
# GEMMs (the tiny model's 128-wide projections prefilled 3-14% slower prepacked).
PACKED_MIN_WEIGHT = int(os.environ.get("CHUNKSCOPE_PREPACK_MIN_WEIGHT", 1 << 18))
# (The override lets bench/soak.py drive the tiny model through the prepacked paths.)

# oneDNN builds a primitive per input shape, and a server sees a new row count almost every
# tick (chunk length + decode rows): unpadded, that grew resident memory without bound (+470 MB
# over 6,000 tiny-model serving ticks; bench/prepack_memory.py: +200 MB over 400 prefills).
# Rows are therefore padded up to a step of 1/8 of their power of two (128-255 -> multiples of
# 16, 256-511 -> 32, 512-1023 -> 64, ...): at most 12.5% padded rows, 8 shapes per octave.
PACKED_STEPS_PER_OCTAVE = 8

# On unless CHUNKSCOPE_ONEDNN_PREPACK=0: with bucketed row counts the memory stays bounded.
PREPACK_ENABLED = os.environ.get("CHUNKSCOPE_ONEDNN_PREPACK", "1") != "0"

# Decode-size inputs (1 to PACKED_MIN_ROWS-1 rows) use the same prepacked copy: skinny calls to
# MKL's sgemm repack the weight on every call. On an AVX2 EPYC, 1 thread, 30 weights of
# 3072x576 (bench/decode_gemm.py): batch 8 streamed 4.0 GB/s through sgemm, 4.7 through MKL's
# packed sgemm and 6.6 through oneDNN's packed copy (batch 32: 2.4 / 2.7 / 3.2; batch 1:
# 11.0 / 16.7 / 13.4). oneDNN wins where decode spends its time and needs no second copy.
# Off with CHUNKSCOPE_DECODE_PREPACK=0.
DECODE_PREPACK_ENABLED = os.environ.get("CHUNKSCOPE_DECODE_PREPACK", "1") != "0"


def _can_prepack(weight: torch.Tensor) -> bool:
    """fp32 CPU weights; bf16 ones too where oneDNN runs bf16 natively (AMX / AVX512-BF16 / AVX-NE-CONVERT)."""
    if not (PREPACK_ENABLED and weight.device.type == "cpu" and weight.numel() >= PACKED_MIN_WEIGHT
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def min_packed_rows() -> int:
    """The fewest input rows that take a prepacked weight (1 with decode prepacking on)."""
    return 1 if DECODE_PREPACK_ENABLED else PACKED_MIN_ROWS


def packed_rows(rows: int) -> int:
    """The bucketed row count a prepacked GEMM runs for ``rows`` input rows (exact below 16)."""
    step = max(1, (1 << (rows.bit_length() - 1)) // PACKED_STEPS_PER_OCTAVE)
    return -(-rows // step) * step


class FusedLinear:
    """``y = x @ weight^T + bias`` over a fixed weight, with a oneDNN-prepacked copy for many-row inputs.

    The copy is made once (``weight`` [out, in] on CPU, float32 or bf16 per ``_can_prepack``, at
    least PACKED_MIN_WEIGHT elements); inputs of at least ``min_packed_rows()`` rows use it (prefill chunks, and decode
    batches unless decode prepacking is off), their row count padded up to ``packed_rows``.
    On other devices or dtypes it is a plain ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True,
                 skinny: bool = True):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        # Decode-sized rows go to the native skinny GEMM (engine/kernels) for large fp32 weights,
        # on its own packed copy (one per weight, whatever the row count): it streams the weight
        # once per call, faster than either library at 1-32 rows. None where it cannot build.
        # ``skinny=False`` for weights that only ever see prefill rows (no copy is made for them).
        self.decode_rows = skinny
        self.skinny_packed = (skinny_gemm.pack(self.weight) if skinny and self.weight.numel() >= PACKED_MIN_WEIGHT
                              else None)  # [ceil(out / 16), in, 16]
        self.skinny = self.skinny_packed is not None  # eager decode rows take the ctypes entry point
        self.packed = None
        if prepack and _can_prepack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 512)

    def pack_for_compiled_decode(self) -> None:
        """The skinny GEMM's packed copy for a weight of any size (one per weight), for a compiled step.

        Eager forwards keep small weights on the library GEMM (``self.skinny`` stays as it was): there the
        ctypes call's Python costs more than the library's small-GEMM overhead. A compiled graph calls the
        kernel as a C++ operator (``torch_ops.cpp``), a dispatcher hop, and the kernel beats MKL on the
        tiny model's shapes (17 GEMMs of a b32 step: 0.79 vs 1.20 ms, AVX2 EPYC, 1 thread).
        """
        if self.decode_rows and self.skinny_packed is None:
            self.skinny_packed = skinny_gemm.pack(self.weight)

    def runs_native(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [T, in] would take the native skinny GEMM (where it was built)."""
        if torch.compiler.is_compiling():
            return self.traced_skinny_applies(x)
        return self.skinny and skinny_gemm.applies(x)

    def traced_skinny_applies(self, x: torch.Tensor) -> bool:
        """While dynamo traces: whether ``x`` [T, in] takes the C++ skinny GEMM operator."""
        return (self.skinny_packed is not None and custom_ops.native_gemm_ready() and x.dim() == 2
                and 0 < x.shape[0] <= skinny_gemm.MAX_ROWS and x.dtype == self.skinny_packed.dtype
                and x.dtype in skinny_gemm.KINDS and x.device.type == "cpu")

    def can_pack(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [T, in] takes the prepacked path (never in a compiled graph: inductor cannot lower
        oneDNN's opaque packed weight, and serve --compile on failed at start on a prepacked model)."""
        return (self.packed is not None and x.dim() == 2 and x.shape[0] >= min_packed_rows()
                and x.dtype == self.weight.dtype and not torch.compiler.is_compiling()
                and not reproducible.active())  # oneDNN picks its kernel by ISA: F.linear, widened, instead

    def packed_call(self, x: torch.Tensor, post_op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        """oneDNN GEMM on already bucketed rows (``pad_rows``): [P, in] -> [P, out].

        ``post_op`` is fused into the GEMM's output pass: "swish" (SiLU), or "mul" / "add"
        with ``other`` [P, out].
        """
        if other is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, post_op, [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, post_op)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] (for padded inputs a view of the first T rows)."""
        if torch.compiler.is_compiling() and self.traced_skinny_applies(x):
            return torch.ops.chunkscope_native.skinny_linear(x, self.skinny_packed, self.bias, self.weight.shape[0])
        if self.skinny:
            out = skinny_gemm.linear(x, self.skinny_packed, self.weight.shape[0], self.bias)
            if out is not None:
                return out
        if not self.can_pack(x):
            return F.linear(x, self.weight, self.bias)
        return self.packed_call(pad_rows(x))[:x.shape[0]]


def decode_projections(model: nn.Module) -> list[FusedLinear | GateUpSiLU]:
    """Every FusedLinear and GateUpSiLU the modules of ``model`` hold (once each, in module order)."""
    found: dict[int, FusedLinear | GateUpSiLU] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (FusedLinear, GateUpSiLU)):
                found.setdefault(id(value), value)
    return list(found.values())


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, in] contiguous with its rows zero-padded up to ``packed_rows(T)`` ([P, in]).

    Zeros, not garbage: a NaN or denormal in a padding row would still cost time. Each output
    row of a GEMM depends on its own input row only, so the real rows are unchanged.
    """
    rows = x.shape[0]
    padded_rows = packed_rows(rows)
    if padded_rows == rows:
        return x.contiguous()
    padded = x.new_empty(padded_rows, x.shape[1])  # [P, in]
    padded[:rows] = x
    padded[rows:].zero_()
    return padded


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are fused into one GEMM after loading."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused_gate_up: GateUpSiLU | None = None
        self.fused_down: FusedLinear | None = None
        self.packed_gate: FusedLinear | None = None  # prepacked gate / up halves, set by fuse()
        self.packed_up: FusedLinear | None = None

    def fuse(self) -> None:
        """Concatenate gate and up weights so the hot path does one GEMM instead of two.

        Where the weights are prepacked, gate and up are packed apart instead: prefill then runs
        gate with SiLU fused into its GEMM and up with the product fused into its own, so no
        separate pass reads and writes the [T, intermediate] activations.
        """
        weight = torch.cat([self.gate_proj.weight, self.up_proj.weight], dim=0)
        self.fused_gate_up = GateUpSiLU(weight, self.intermediate_size, PACKED_MIN_WEIGHT)  # SiLU(gate) * up
        self.fused_down = FusedLinear(self.down_proj.weight)
        gate, up = weight.split(self.intermediate_size)  # views: the packed copies are the only new memory
        # Prefill-only halves: decode rows run the fused weight's skinny GEMM (one copy, not three).
        self.packed_gate, self.packed_up = FusedLinear(gate, skinny=False), FusedLinear(up, skinny=False)
        if self.packed_gate.packed is None or self.packed_up.packed is None or self.fused_down.packed is None:
            self.packed_gate = self.packed_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.packed_gate is not None and self.packed_gate.can_pack(x) and not self.fused_gate_up.runs_native(x):
            padded = pad_rows(x)  # [P, hidden]
            act = self.packed_gate.packed_call(padded, "swish")  # [P, intermediate]
            act = self.packed_up.packed_call(padded, "mul", act)
            return self.fused_down.packed_call(act)[:x.shape[0]]
        return self.fused_down(self.fused_gate_up(x))


class PartialRotary(nn.Module):
    """Rotary embedding on the first ``rotary_dim`` channels of each head (rotate-half layout).

    Text-only Qwen3.5 uses the same position on all three mRoPE axes, which reduces the
    interleaved mRoPE to this plain rotary embedding.
    """

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [T, 1, rotary_dim] and the signed sin [T, 1, rotary_dim] for ``apply``, once per forward.

        The sin's first half is negated: rotate_half(x) * sin == swap_halves(x) * signed_sin exactly
        (a sign flip rounds nothing), so ``apply`` needs no negation and no second cat per call.
        """
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None, None] * self.inv_freq  # [T, 1, rotary_dim / 2]
        sin = freqs.sin()
        return torch.cat([freqs, freqs], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos / signed sin from ``cos_sin``: [T, 1, rotary_dim]. Returns a new [T, H, D]."""
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)  # [T, H, rotary_dim]
        return torch.cat([rot * cos + swapped * sin, x[..., self.rotary_dim:]], dim=-1)
