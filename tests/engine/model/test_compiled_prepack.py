"""Prepacked weights under torch.compile: the graph takes the plain GEMM, never oneDNN's opaque packed copy.

Inductor cannot lower ``mkldnn._linear_pointwise`` on a packed weight: ``serve --compile on`` on a
model with prepacked weights (SmolLM-size, or the tiny model with CHUNKSCOPE_PREPACK_MIN_WEIGHT=0
as bench/soak.py runs it) stopped at start with a LoweringException.
"""
from __future__ import annotations

import torch

from engine.model import layers


def _traced_targets(fn, *inputs) -> tuple[list[str], torch.Tensor]:
    """The call targets of the graph dynamo captures for ``fn`` (one graph, no break), and its result."""
    targets: list[str] = []

    def record(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        out = torch.compile(fn, backend=record, fullgraph=True)(*inputs)
    return targets, out


def test_compiled_graphs_do_not_call_the_prepacked_gemm(monkeypatch):
    monkeypatch.setattr(layers, "PACKED_MIN_WEIGHT", 0)
    monkeypatch.setattr(layers, "DECODE_PREPACK_ENABLED", True)
    torch.manual_seed(0)
    linear = layers.FusedLinear(torch.randn(64, 32))
    mlp = layers.SwiGLU(32, 24)
    with torch.inference_mode():
        mlp.fuse()
    if linear.packed is None or mlp.packed_gate is None:  # no oneDNN here: nothing is prepacked
        return
    x = torch.randn(4, 32)
    assert linear.can_pack(x) and mlp.packed_gate.can_pack(x)  # eager: the packed copies serve these rows
    for fn in (linear, mlp):
        targets, out = _traced_targets(fn, x)
        assert targets and not any("mkldnn" in target for target in targets), targets
        with torch.inference_mode():
            assert torch.allclose(out, fn(x), rtol=1e-5, atol=1e-5)
