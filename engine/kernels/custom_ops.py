"""The native decode kernels as torch custom ops, so a compiled decode step traces through them.

The kernels are ctypes calls on ``data_ptr()``s, which dynamo cannot trace: under
``torch.compile`` the Python entry points step aside (they return None) and the graph used to
take the torch paths instead: a gathered dense K/V per attention layer, and the tensor GDN
step whose pool write-back inductor turned into copies. Registered as ops with a fake
implementation giving the output's shape, they become single nodes of the graph; the in-place
pool and store writes are declared in the schemas (``Tensor(a!)``) and made on the pools and the
store themselves (the whole tensors, indexed inside the op), so functionalization has nothing
to copy back.

They are defined through ``torch.library.Library`` with a CPU kernel only, not through
``torch.library.custom_op``: the latter's Python wrapper layers (autograd, ADInplaceOrView,
``fill_defaults`` over the schema) cost ~0.1-0.2 ms per call, more than the tiny model's whole
attention; a compiled step only ever runs them under inference mode, with no autograd.

Where the C++ operators build (``torch_ops.py``: the same kernels and schemas, namespace
``chunkscope_native``, registered with C++ CPU kernels), a graph calls those instead: a dispatcher
hop where these Python kernels cost 30-50 us of argument checks and ctypes marshalling a call.

Each ``*_traced`` function is what a layer calls while dynamo traces: the op where the kernel
applies (checked on shapes, dtypes and strides only: fake tensors have no data), else None and
the layer keeps its torch path.
"""
from __future__ import annotations

import torch

from engine.kernels import gdn_step, native, paged_attention, skinny_gemm, torch_ops

_NS = "chunkscope"
_LIB = torch.library.Library(_NS, "DEF")  # kept alive: the registrations live as long as it does
_LIB.define("paged_decode_attention(Tensor q, Tensor new_keys, Tensor new_values, Tensor(a!) keys, "
            "Tensor(b!) values, Tensor kv_slots, Tensor block_tables, Tensor context_lens, Tensor gate) -> Tensor")
_LIB.define("gdn_decode_gated(Tensor mixed, Tensor(a!) conv_pool, Tensor(b!) rec_pool, int layer, "
            "Tensor conv_weight, Tensor slots, Tensor a, Tensor b, Tensor neg_rate, Tensor dt_bias, Tensor z, "
            "Tensor norm_weight, float eps, int num_k_heads, int key_dim, int value_dim) -> Tensor")
# Which kernels loaded, set by ``load_kernels`` before a trace: building or opening a library
# (file system calls) inside one would break the graph.
_ready = {"attention": False, "gdn": False, "torch_ops": False, "skinny_gemm": False}


def load_kernels(cpu_operators: bool = True) -> dict[str, bool]:
    """Build / open the kernels the ops call (eagerly, before any trace); which of them are ready.

    ``cpu_operators=False`` (a step on a GPU) skips building the C++ operators: no graph would call them.
    """
    _ready["attention"] = paged_attention.available()
    _ready["gdn"] = gdn_step.available()
    _ready["torch_ops"] = cpu_operators and _ready["attention"] and _ready["gdn"] and torch_ops.available()
    # The skinny GEMM is single-threaded: with more torch threads the graph keeps the library GEMMs,
    # which split the work (decided here: dynamo cannot trace torch.get_num_threads()).
    _ready["skinny_gemm"] = _ready["torch_ops"] and skinny_gemm.ENABLED and torch.get_num_threads() == 1
    return dict(_ready)


def native_ops_ready() -> bool:
    """Whether a trace may call ``torch.ops.chunkscope_native`` (built and loaded by ``load_kernels``)."""
    return _ready["torch_ops"] and native.enabled()


def native_gemm_ready() -> bool:
    """Whether a trace may call ``chunkscope_native::skinny_linear`` for decode-sized rows."""
    return _ready["skinny_gemm"] and native_ops_ready()


def _ops():
    """The namespace a trace calls: the C++ operators where they loaded, else this module's."""
    return torch.ops.chunkscope_native if native_ops_ready() else torch.ops.chunkscope


# ---- paged decode attention (with the new K/V written first) -------------------------------------
def _paged_decode_attention(q: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, keys: torch.Tensor,
                            values: torch.Tensor, kv_slots: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Write new_keys / new_values [B, Hkv, D] at flat ``kv_slots`` [B] of the store keys / values
    [N, block, Hkv, D], then each row's gated attention over its context -> [B, H * D]."""
    out = paged_attention.decode(q, keys, values, block_tables, context_lens, gate,
                                 new_kv=(new_keys, new_values, kv_slots))
    if out is None:  # strides the trace-time check did not foresee: the kernel's own layout
        out = paged_attention.decode(q.contiguous(), keys, values, block_tables.contiguous(),
                                     context_lens.contiguous(), gate.contiguous(),
                                     new_kv=(new_keys.contiguous(), new_values.contiguous(), kv_slots.contiguous()))
    if out is None:
        raise RuntimeError("chunkscope::paged_decode_attention: the native kernel is unavailable here")
    return out


@torch.library.register_fake(f"{_NS}::paged_decode_attention", lib=_LIB)
def _paged_decode_attention_fake(q, new_keys, new_values, keys, values, kv_slots, block_tables, context_lens, gate):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_LIB.impl("paged_decode_attention", _paged_decode_attention, "CPU")


def paged_decode_attention_traced(q: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                                  keys: torch.Tensor, values: torch.Tensor, kv_slots: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  gate: torch.Tensor) -> torch.Tensor | None:
    """The op (K/V write + gated attention, [B, H * D]) where the kernel applies, else None."""
    if not (native.enabled() and _ready["attention"] and new_keys.dtype == keys.dtype
            and _attention_fits(q, keys, values, block_tables, context_lens, gate)):
        return None
    return _ops().paged_decode_attention(q, new_keys, new_values, keys, values, kv_slots, block_tables,
                                         context_lens, gate)


def _attention_fits(q, keys, values, block_tables, context_lens, gate) -> bool:
    floats = (q, keys, values, gate)  # a float32 store, or a bf16 one with bf16 q and gate
    return (keys.dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == keys.dtype and t.device.type == "cpu" for t in floats)
            and q.dim() == 3 and keys.dim() == 4 and keys.shape == values.shape and keys.shape[3] == q.shape[2]
            and q.shape[1] % keys.shape[2] == 0 and gate.shape == q.shape
            and block_tables.dtype == torch.long == context_lens.dtype and block_tables.dim() == 2)


# ---- the Gated DeltaNet decode step (gates and output norm inside) -------------------------------
def _gdn_decode_gated(mixed: torch.Tensor, conv_pool: torch.Tensor, rec_pool: torch.Tensor, layer: int,
                      conv_weight: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      neg_rate: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, num_k_heads: int, key_dim: int, value_dim: int) -> torch.Tensor:
    """``gdn_step.decode_gated`` on linear layer ``layer`` of the whole pools conv [L, S, C, K-1] and
    recurrent [L, S, Hv, Dk, Dv] (updated in place at ``slots``) -> [B, Hv * Dv]."""
    conv, rec = conv_pool[layer], rec_pool[layer]
    out = gdn_step.decode_gated(mixed, conv, conv_weight, rec, slots, a, b, neg_rate, dt_bias, z, norm_weight, eps,
                                num_k_heads, key_dim, value_dim)
    if out is None:  # strides the trace-time check did not foresee: contiguous inputs
        out = gdn_step.decode_gated(mixed.contiguous(), conv, conv_weight.contiguous(), rec, slots.contiguous(),
                                    a.contiguous(), b.contiguous(), neg_rate.contiguous(), dt_bias.contiguous(),
                                    z.contiguous(), norm_weight.contiguous(), eps, num_k_heads, key_dim, value_dim)
    if out is None:
        raise RuntimeError("chunkscope::gdn_decode_gated: the native kernel is unavailable here")
    return out


@torch.library.register_fake(f"{_NS}::gdn_decode_gated", lib=_LIB)
def _gdn_decode_gated_fake(mixed, conv_pool, rec_pool, layer, conv_weight, slots, a, b, neg_rate, dt_bias, z,
                           norm_weight, eps, num_k_heads, key_dim, value_dim):
    return mixed.new_empty(mixed.shape[0], rec_pool.shape[2] * value_dim)


_LIB.impl("gdn_decode_gated", _gdn_decode_gated, "CPU")


def gdn_decode_gated_traced(mixed: torch.Tensor, conv_pool: torch.Tensor, rec_pool: torch.Tensor, layer: int,
                            conv_weight: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                            neg_rate: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float, num_k_heads: int, key_dim: int,
                            value_dim: int) -> torch.Tensor | None:
    """The op where the native step applies (float32 CPU, pools of this layer's shape), else None."""
    tensors = (mixed, conv_pool, rec_pool, conv_weight, a, b, neg_rate, dt_bias, z, norm_weight)
    if not (native.enabled() and _ready["gdn"]
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and conv_pool.dim() == 4 and rec_pool.dim() == 5 and rec_pool.shape[3:] == (key_dim, value_dim)
            and rec_pool.shape[2] % num_k_heads == 0 and conv_pool.is_contiguous() and rec_pool.is_contiguous()
            and mixed.dim() == 2 and mixed.shape[1] == conv_pool.shape[2] == conv_weight.shape[0]
            and slots.dtype == torch.long):
        return None
    return _ops().gdn_decode_gated(mixed, conv_pool, rec_pool, layer, conv_weight, slots, a, b, neg_rate, dt_bias,
                                   z, norm_weight, eps, num_k_heads, key_dim, value_dim)
