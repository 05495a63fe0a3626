"""The reproducible-numerics mode (``--numerics reproducible``): a forward whose numbers do not depend on
which CPU kernels (AVX2, AVX-512, AMX code paths of MKL, oneDNN and ATen) the machine picks.

How: while the mode is entered (a ``TorchFunctionMode`` around each scheduler step), every op that
reduces (GEMMs, batched matmuls, the depthwise conv, attention, sums and means, cumsum, the
triangular solve, norms, softmax) and every transcendental (exp, sigmoid, SiLU, softplus, rsqrt,
cos / sin) runs in float64 and is rounded to the dtype the op would have returned. The ISA variants of
a float64 kernel differ in their last float64 bits (a reduction's lane count, a vectorized exp vs
its scalar tail); rounding to float32 / bfloat16 removes those differences unless a float64 value
lies within a float64 ulp of a rounding boundary of the narrow dtype (about 2^-29 of float32 values,
2^-45 of bfloat16 ones). The elementwise ops left as they are (add, mul, sub, div, casts) are IEEE
exact on every ISA. The paths whose kernels are chosen per ISA outside torch are off in the mode:
the native ctypes kernels (``engine/kernels``), oneDNN's prepacked weights and the compiled decode
step. It also removes the batch shape from the numbers of the GEMMs (a float64 result rounded to
float32 is the same however the library blocked it), which is what a flipped replay needs.

What it costs: bench/numerics.py. Which models it covers: ``check_supported`` (the Qwen3.5 dense
decoder on one rank; it refuses the others in one line rather than run them unaudited).
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

NUMERICS_CHOICES = ("native", "reproducible")
REPRODUCIBLE = "reproducible"
NATIVE = "native"

_Tensor = torch.Tensor
# Ops whose result depends on a reduction order or a vectorized transcendental: run in float64.
WIDENED = {
    F.linear, torch.matmul, _Tensor.matmul, _Tensor.__matmul__, torch.mm, _Tensor.mm, torch.bmm, _Tensor.bmm,
    torch.baddbmm, _Tensor.baddbmm, _Tensor.baddbmm_, torch.addmm, _Tensor.addmm, torch.einsum,
    torch.conv1d, F.conv1d, F.scaled_dot_product_attention,
    torch.sum, _Tensor.sum, torch.mean, _Tensor.mean, torch.cumsum, _Tensor.cumsum, torch.logsumexp,
    _Tensor.logsumexp, torch.linalg.solve_triangular, torch.linalg.vector_norm, torch.norm, _Tensor.norm,
    torch.softmax, _Tensor.softmax, F.softmax, torch.log_softmax, _Tensor.log_softmax, F.log_softmax,
    torch.exp, _Tensor.exp, _Tensor.exp_, torch.sigmoid, _Tensor.sigmoid, _Tensor.sigmoid_, F.silu,
    F.softplus, torch.rsqrt, _Tensor.rsqrt, torch.sqrt, _Tensor.sqrt, torch.log, _Tensor.log, torch.log1p,
    torch.cos, _Tensor.cos, torch.sin, _Tensor.sin, torch.tanh, _Tensor.tanh, torch.pow, _Tensor.pow,
    torch.float_power, _Tensor.__rpow__,
}
_INPLACE = {_Tensor.baddbmm_: _Tensor.baddbmm, _Tensor.exp_: _Tensor.exp, _Tensor.sigmoid_: _Tensor.sigmoid}

_state = threading.local()


def active() -> bool:
    """Whether this thread runs inside the mode (native kernels and prepacked weights check it)."""
    return getattr(_state, "depth", 0) > 0


def _widen(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.double()
    if isinstance(value, (list, tuple)):
        return type(value)(_widen(v) for v in value)
    return value


def _result_dtype(args, kwargs) -> torch.dtype | None:
    """The dtype the op would have returned: its ``dtype=`` argument, else its floating inputs' promotion."""
    if isinstance(kwargs.get("dtype"), torch.dtype):
        return kwargs["dtype"]
    found = None
    for value in list(args) + list(kwargs.values()):
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                found = item.dtype if found is None else torch.promote_types(found, item.dtype)
    return found


def _narrow(result, dtype: torch.dtype):
    if isinstance(result, torch.Tensor):
        return result.to(dtype) if result.is_floating_point() and result.dtype != dtype else result
    if isinstance(result, tuple):
        return type(result)(*(_narrow(r, dtype) for r in result)) if hasattr(result, "_fields") \
            else tuple(_narrow(r, dtype) for r in result)
    return result


class ReproducibleNumerics(TorchFunctionMode):
    """The mode itself: ``WIDENED`` ops in float64, rounded back at the op's boundary."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in WIDENED:
            return func(*args, **kwargs)
        dtype = _result_dtype(args, kwargs)
        if dtype is None or dtype == torch.float64:
            return func(*args, **kwargs)
        out = kwargs.pop("out", None)
        wide_kwargs = {k: (torch.float64 if k == "dtype" and isinstance(v, torch.dtype) else _widen(v))
                       for k, v in kwargs.items()}
        if func in _INPLACE:  # computed out of place in float64, written back into self
            target = args[0]
            target.copy_(_INPLACE[func](*_widen(args), **wide_kwargs))
            return target
        result = func(*_widen(args), **wide_kwargs)
        if out is not None:
            out.copy_(result)
            return out
        return _narrow(result, dtype)


@contextlib.contextmanager
def entered(numerics: str):
    """The mode around a block when ``numerics`` is 'reproducible'; nothing for 'native'."""
    if numerics != REPRODUCIBLE:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with ReproducibleNumerics():
            yield
    finally:
        _state.depth -= 1


def check_choice(numerics: str) -> str:
    if numerics not in NUMERICS_CHOICES:
        raise ValueError(f"--numerics must be one of {', '.join(NUMERICS_CHOICES)}, got {numerics!r}")
    return numerics


def check_supported(model, *, ep_size: int, device: str) -> None:
    """Refuse, in one line, a run the mode does not cover (its ops were audited on the dense Qwen3.5 only)."""
    name = type(model).__name__  # by name: importing the model here would close an import cycle via the kernels
    if not str(device).startswith("cpu"):
        raise ValueError(f"--numerics reproducible runs on CPU only (device {device}): GPU kernels are not covered")
    if ep_size > 1:
        raise ValueError("--numerics reproducible does not cover expert parallelism (--ep): collectives are not pinned")
    if (type(model).__module__, name) != ("engine.model.qwen3_5", "Qwen35ForCausalLM") or model.is_mla:
        raise ValueError(f"--numerics reproducible covers the dense Qwen3.5 decoder (tiny or a Qwen3.5 checkpoint); "
                         f"{name} (MoE routing, Kimi MLA/KDA, vision) is not covered")
