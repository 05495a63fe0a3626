"""Decode attention straight from the paged KV store (paged_attention.cpp) where it applies, else None.

Each row reads its own context through its block table: no gathered [B, S, Hkv, D] copy of
K and V per layer, no mask over the padded table, and the output gate (``out * sigmoid(gate)``)
and the [B, H * D] layout o_proj wants come out of the same call. A float32 store, or a bf16 one
(a bf16 model's: each K and V element widened as it is read, q and the gate widened before the
call, the output rounded back to bf16 once), on any kernel variant (native.VARIANTS).
"""
from __future__ import annotations

import ctypes

import torch

from engine.kernels import native

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _NewKV(ctypes.Structure):
    """paged_attention.cpp's NewKV: the rows' own K/V, written into the store before attending."""
    _fields_ = [("keys", _PTR), ("values", _PTR), ("ldk_row", _I64), ("ldk_head", _I64), ("ldv_row", _I64),
                ("ldv_head", _I64), ("slots", _PTR)]


_SIGNATURE = (_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64,
              ctypes.POINTER(_NewKV), _I64, _I64, _I64, _I64, ctypes.c_float, _PTR)


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # by the store's dtype


def _kernel(store_dtype: torch.dtype = torch.float32):
    return native.bind("paged_attention", f"paged_decode_attention_{_SUFFIX[store_dtype]}", _SIGNATURE, ctypes.c_int)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call; False, logged once, where it cannot)."""
    return _kernel() is not None


def applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, gate: torch.Tensor | None) -> bool:
    """Shapes, dtypes and strides the kernel takes (CPU; a float32 store with float32 q and gate, or a bf16
    store with q and gate of its dtype; unit inner strides; contiguous store)."""
    if torch.compiler.is_compiling() or not native.enabled():  # a compiled graph calls the custom op instead
        return False
    floats = (q, keys, values) + (() if gate is None else (gate,))
    if keys.dtype not in _SUFFIX or not all(t.dtype == keys.dtype and t.device.type == "cpu" for t in floats):
        return False
    if q.dim() != 3 or keys.dim() != 4 or keys.shape != values.shape:
        return False
    batch, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    return (keys.shape[3] == head_dim and heads % kv_heads == 0 and q.stride(2) == 1
            and keys.is_contiguous() and values.is_contiguous()
            and (gate is None or (gate.shape == q.shape and gate.stride(2) == 1))
            and block_tables.dtype == torch.long == context_lens.dtype and block_tables.dim() == 2
            and block_tables.shape[0] == batch and block_tables.stride(1) == 1
            and context_lens.shape == (batch,) and context_lens.is_contiguous()
            and block_tables.device.type == "cpu" == context_lens.device.type)


def _fits_new_kv(q: torch.Tensor, keys: torch.Tensor, new_kv) -> bool:
    new_keys, new_values, slots = new_kv
    shape = (q.shape[0], keys.shape[2], keys.shape[3])
    return (new_keys.shape == shape == new_values.shape and new_keys.dtype == keys.dtype == new_values.dtype
            and new_keys.device.type == "cpu" == new_values.device.type and new_keys.stride(2) == 1
            and new_values.stride(2) == 1 and slots.dtype == torch.long and slots.shape == (q.shape[0],)
            and slots.is_contiguous() and slots.device.type == "cpu")


def decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, gate: torch.Tensor | None = None, scale: float | None = None,
           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Each row's query heads over its context -> [B, H * D] (times sigmoid(gate) when given), or None.

    q, gate [B, H, D]; keys, values the layer's store [num_blocks, block_size, Hkv, D];
    block_tables [B, W] long; context_lens [B] long (row b sees positions 0 .. len - 1).
    ``new_kv``: (keys [B, Hkv, D], values [B, Hkv, D], flat slots [B] long) written into the
    store first (the rows' own K/V, which they attend to). None where the kernel does not apply
    here (nothing written); ValueError (nothing written) for a context, block id or slot out of range.
    """
    if not (applies(q, keys, values, block_tables, context_lens, gate) and available()):
        return None
    if new_kv is not None and not _fits_new_kv(q, keys, new_kv):
        return None
    store_dtype = keys.dtype
    if store_dtype != torch.float32:  # the kernel reads q and the gate in float32
        q, gate = q.float(), None if gate is None else gate.float()
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = keys.shape
    out = q.new_empty(batch, heads * head_dim)  # [B, H * D]
    gate_ptr, ldg_row, ldg_head = (None, 0, 0) if gate is None else (gate.data_ptr(), gate.stride(0), gate.stride(1))
    write = None
    if new_kv is not None:
        new_keys, new_values, slots = new_kv
        write = ctypes.byref(_NewKV(new_keys.data_ptr(), new_values.data_ptr(), new_keys.stride(0), new_keys.stride(1),
                                    new_values.stride(0), new_values.stride(1), slots.data_ptr()))
    status = _kernel(store_dtype)(
        q.data_ptr(), q.stride(0), q.stride(1), keys.data_ptr(), values.data_ptr(), num_blocks, block_size,
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], context_lens.data_ptr(),
        gate_ptr, ldg_row, ldg_head, write, batch, heads, kv_heads, head_dim,
        head_dim ** -0.5 if scale is None else scale, out.data_ptr())
    if status != 0:
        raise ValueError(f"paged decode attention: a context length outside 1 .. {block_tables.shape[1] * block_size},"
                         f" a block id outside 0 .. {num_blocks - 1} or a new K/V slot outside the store")
    return out if store_dtype == torch.float32 else out.to(store_dtype)
