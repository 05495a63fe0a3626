"""A Gated DeltaNet layer's decode step in one native call (gdn_step.cpp) where it applies, else None.

The same arithmetic as gdn.py's tensor path (causal conv + SiLU, l2-normalised q and k, the
recurrence of ``engine.model.gdn_rule.recurrent_gated_delta_step``), with each sequence's
conv and recurrent state read and written once, in place in the layer's pools (through the
rows' slot indices: no gather, no scatter). The tensor path makes ~25 small ops per layer,
and its conv reduces over a 4-wide inner dim, which torch does slowly.
"""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import native

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR)
_GATED_SIGNATURE = (_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                    ctypes.c_float, _I64, _I64, _I64, _I64, _I64, _PTR)


def _kernel():
    return native.bind("gdn_step", "gdn_decode_f32", _SIGNATURE)


def _gated_kernel():
    return native.bind("gdn_step", "gdn_decode_gated_f32", _GATED_SIGNATURE)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call; False, logged once, where it cannot)."""
    return _kernel() is not None and _gated_kernel() is not None


def _fits(mixed, conv_states, conv_weight, rec_states, slots, g, beta, num_k_heads, key_dim, value_dim) -> bool:
    tensors = (mixed, conv_states, conv_weight, rec_states, g, beta)
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return False
    batch, channels = mixed.shape
    value_heads = rec_states.shape[1]
    return (mixed.stride(1) == 1 and conv_states.is_contiguous() and conv_weight.is_contiguous()
            and rec_states.is_contiguous() and channels == 2 * num_k_heads * key_dim + value_heads * value_dim
            and conv_states.shape[1] == channels and conv_weight.shape == (channels, conv_states.shape[2] + 1)
            and rec_states.shape[2:] == (key_dim, value_dim) and value_heads % num_k_heads == 0
            and g.shape == beta.shape == (batch, value_heads) and g.stride() == beta.stride() and g.stride(1) == 1
            and slots.dtype == torch.long and slots.shape == (batch,) and slots.is_contiguous())


def decode(mixed: torch.Tensor, conv_states: torch.Tensor, conv_weight: torch.Tensor, rec_states: torch.Tensor,
           slots: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, num_k_heads: int, key_dim: int,
           value_dim: int) -> torch.Tensor | None:
    """One token per row; returns the recurrence's outputs [B, Hv, Dv], or None where the kernel does not apply.

    mixed [B, C] the pre-conv q|k|v projections (C = 2 Hk Dk + Hv Dv); conv_states [S, C, K-1]
    and rec_states [S, Hv, Dk, Dv] the layer's pools, updated in place at ``slots`` [B] (long,
    valid and distinct: the caller's guarantee); conv_weight [C, K]; g, beta [B, Hv].
    """
    if (torch.compiler.is_compiling() or not native.enabled()
            or not _fits(mixed, conv_states, conv_weight, rec_states, slots, g, beta, num_k_heads, key_dim, value_dim)
            or not available()):
        return None
    batch = mixed.shape[0]
    value_heads = rec_states.shape[1]
    out = mixed.new_empty(batch, value_heads, value_dim)  # [B, Hv, Dv]
    _kernel()(mixed.data_ptr(), mixed.stride(0), conv_states.data_ptr(), conv_weight.data_ptr(), conv_weight.shape[1],
        rec_states.data_ptr(), slots.data_ptr(), g.data_ptr(), beta.data_ptr(), g.stride(0), batch, num_k_heads,
        value_heads, key_dim, value_dim, out.data_ptr())
    return out


def decode_gated(mixed: torch.Tensor, conv_states: torch.Tensor, conv_weight: torch.Tensor, rec_states: torch.Tensor,
                 slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_rate: torch.Tensor, dt_bias: torch.Tensor,
                 z: torch.Tensor, norm_weight: torch.Tensor, eps: float, num_k_heads: int, key_dim: int,
                 value_dim: int) -> torch.Tensor | None:
    """``decode`` with the gates and the output norm inside the call: -> [B, Hv * Dv] for out_proj, or None.

    a, b [B, Hv] the raw gate projections (beta = sigmoid(b), g = neg_rate * softplus(a +
    dt_bias), neg_rate and dt_bias [Hv]); z [B, Hv * Dv] the norm's gate; norm_weight [Dv]:
    each head's output o becomes norm_weight * o / rms(o) * silu(z), as GatedRMSNorm in float32.
    The torch path around it (~8 small ops per layer) is gone; float32 only.
    """
    batch = mixed.shape[0]
    value_heads = rec_states.shape[1]
    small = (a, b, neg_rate, dt_bias, z, norm_weight)
    if (torch.compiler.is_compiling() or not native.enabled()
            or not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in small)
            or a.shape != (batch, value_heads) or b.shape != a.shape or a.stride(0) != b.stride(0)
            or neg_rate.shape != (value_heads,) or dt_bias.shape != (value_heads,)
            or z.shape != (batch, value_heads * value_dim) or norm_weight.shape != (value_dim,)
            or not _fits(mixed, conv_states, conv_weight, rec_states, slots, a, b, num_k_heads, key_dim, value_dim)
            or not available()):
        return None
    out = mixed.new_empty(batch, value_heads * value_dim)  # [B, Hv * Dv]
    _gated_kernel()(mixed.data_ptr(), mixed.stride(0), conv_states.data_ptr(), conv_weight.data_ptr(), conv_weight.shape[1],
              rec_states.data_ptr(), slots.data_ptr(), a.data_ptr(), b.data_ptr(), a.stride(0), neg_rate.data_ptr(),
              dt_bias.data_ptr(), z.data_ptr(), z.stride(0), norm_weight.data_ptr(), eps, batch, num_k_heads,
              value_heads, key_dim, value_dim, out.data_ptr())
    return out
