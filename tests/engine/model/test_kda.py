"""Kimi Delta Attention: the chunked rule equals the one-token step, and the layer's state captures are exact."""
from __future__ import annotations

import pytest
import torch

from engine.cache.sequence import SequenceState
from engine.model.forward_batch import ForwardBatch
from engine.model.gdn import SSMRowStates
from engine.model.kda_rule import chunked_kda_rule, recurrent_kda_step
from engine.model.loader import load_model
from engine.model.runner import ModelRunner


@pytest.mark.parametrize("length, chunk", [(1, 16), (15, 16), (16, 16), (45, 16), (45, 7)])
def test_chunked_rule_equals_token_by_token_steps(length, chunk):
    gen = torch.Generator().manual_seed(length * chunk)
    heads, dim = 3, 8
    q, k, v = (torch.nn.functional.normalize(torch.randn(heads, length, dim, generator=gen), dim=-1)
               for _ in range(3))
    g = -torch.rand(heads, length, dim, generator=gen) * 3  # per-channel log-decays, some strong
    beta = torch.rand(heads, length, generator=gen)
    state = torch.randn(heads, dim, dim, generator=gen) * 0.1
    out, final = chunked_kda_rule(q, k, v, g, beta, state.clone(), chunk_size=chunk)
    stepped, outs = state.clone()[None], []
    for t in range(length):
        outs.append(recurrent_kda_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t],
                                       stepped))
    torch.testing.assert_close(out, torch.cat(outs).transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, stepped[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_kimi():
    model, _, _ = load_model("tiny-kimi")
    return model


def _prompt(n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_mid_chunk_capture_equals_the_state_at_that_prefix(tiny_kimi):
    prompt = _prompt(40)
    runner = ModelRunner.build(tiny_kimi, num_kv_blocks=8, num_ssm_slots=2)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    captured = runner.forward(ForwardBatch.chunk(seq, prompt, 0, 40, True, capture_at=24)).capture
    other = SequenceState(1)
    runner.pools.admit(other)
    runner.prefill_chunk(other, prompt, 0, 24, False)
    expected = runner.pools.ssm.snapshot(other.ssm_slot)
    torch.testing.assert_close(captured.conv, expected.conv)
    torch.testing.assert_close(captured.recurrent, expected.recurrent, rtol=1e-5, atol=1e-6)


def test_every_row_states_equal_decode_steps(tiny_kimi):
    """The speculative verify's per-row states: row r's state is what r + 1 decode steps leave."""
    from engine.model.batch import build_batch

    prompt, extra = _prompt(20), [5, 9, 77]
    runner = ModelRunner.build(tiny_kimi, num_kv_blocks=8, num_ssm_slots=2)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    runner.prefill_chunk(seq, prompt, 0, 20, False)
    before = runner.pools.ssm.snapshot(seq.ssm_slot)
    runner.pools.blocks.allocate(seq, len(extra))
    batch = build_batch((extra, 20, seq.block_table, seq.ssm_slot), [], runner.kv_block_size)
    batch.ssm_row_states = row_states = SSMRowStates()
    tiny_kimi(batch, runner.pools.kv_store, runner.pools.ssm)
    runner.pools.ssm.restore(before, seq.ssm_slot)
    for r, token in enumerate(extra):
        step = build_batch(None, [(token, 20 + r, seq.block_table, seq.ssm_slot)], runner.kv_block_size)
        tiny_kimi(step, runner.pools.kv_store, runner.pools.ssm)
        for index, kept in row_states.recurrent.items():
            torch.testing.assert_close(kept[r], runner.pools.ssm.recurrent[index, seq.ssm_slot], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(row_states.conv[index][r], runner.pools.ssm.conv[index, seq.ssm_slot])
