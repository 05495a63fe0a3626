"""The parity checks on CUDA (opt in with --gpu on a machine that has one)."""
from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.forward_batch import ForwardBatch, PrefillChunk
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


def test_cuda_logits_and_greedy_match_transformers(hf_checkpoint, cuda):
    hf_model, directory = hf_checkpoint("base")
    model, config, _ = load_model(directory, device=cuda)
    prompt = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
        ids = torch.tensor([prompt])
        hf_tokens = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                      min_new_tokens=32, do_sample=False,
                                      pad_token_id=config.vocab_size - 1)[0, 45:].tolist()
    runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=2, device=cuda)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    logits = runner.prefill_chunk(seq, prompt, 0, len(prompt), True)
    assert (logits.cpu() - expected).abs().max().item() <= 1e-3  # TF32-free fp32 on GPU, looser than CPU
    tokens = [int(logits.argmax())]
    for _ in range(31):
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    assert tokens == hf_tokens


def test_cuda_mixed_forward_matches_separate(hf_checkpoint, cuda):
    _, directory = hf_checkpoint("base")
    model, _, _ = load_model(directory, device=cuda)
    separate, fused = (ModelRunner.build(model, 32, 3, device=cuda) for _ in range(2))
    out = []
    for runner in (separate, fused):
        a, b = SequenceState(0), SequenceState(1)
        runner.pools.admit(a)
        runner.pools.admit(b)
        token = int(runner.prefill_chunk(a, list(range(1, 30)), 0, 29, True).argmax())
        if runner is separate:
            pre = runner.prefill_chunk(b, list(range(5, 45)), 0, 40, True)
            dec = runner.decode([a], [token])
        else:
            out = runner.forward(ForwardBatch.mixed([a], [token], PrefillChunk(b, list(range(5, 45)), 0, 40, True)))
            pre, dec = out.prefill_logits, out.decode_logits
        out.append((pre, dec))
    assert (out[0][0] - out[1][0]).abs().max().item() <= 1e-4
    assert (out[0][1] - out[1][1]).abs().max().item() <= 1e-4
