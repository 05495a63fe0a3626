"""The autograd form of the gated delta rule computes what the serving form does, and trains."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.gdn_rule import chunked_gated_delta_rule
from engine.train.delta_rule import differentiable_gated_delta_rule


def inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, 16, generator=g)
    k = F.normalize(torch.randn(2, length, 16, generator=g), dim=-1)
    v = torch.randn(4, length, 8, generator=g)
    decay = -torch.rand(4, length, generator=g) * 3   # strongly decaying heads reach the clamp
    beta = torch.rand(4, length, generator=g)
    state = torch.randn(4, 16, 8, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 7, 32, 77])   # one token, a padded chunk, one chunk, padded chunks
def test_outputs_and_final_state_match_the_serving_rule(length):
    q, k, v, g, beta, state = inputs(length)
    served, served_state = chunked_gated_delta_rule(q, k, v, g, beta, state.clone())
    trained, trained_state = differentiable_gated_delta_rule(q, k, v, g, beta, state.clone())
    assert trained.shape == served.shape == (4, length, 8)
    torch.testing.assert_close(trained, served, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trained_state, served_state, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_input_and_the_callers_state_is_left_alone():
    q, k, v, g, beta, state = (x.requires_grad_() for x in inputs(40, seed=1))
    pool = state.detach().clone()
    out, final = differentiable_gated_delta_rule(q, k, v, g, beta, pool)
    pool.zero_()   # the caller overwrites its pool slot: the backward pass must not read it
    (out.square().sum() + final.sum()).backward()
    for tensor in (q, k, v, g, beta):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all() and tensor.grad.abs().sum() > 0
