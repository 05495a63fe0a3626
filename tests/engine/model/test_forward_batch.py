"""The value a forward runs (``ForwardBatch``): its three shapes, the checks the runner makes before it
takes any block, and the output's rows."""
from __future__ import annotations

import pytest

from engine.cache.sequence import SequenceState
from engine.model.forward_batch import ForwardBatch, PrefillChunk
from engine.model.loader import load_model
from engine.model.runner import ModelRunner


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")[0]


def admitted(runner: ModelRunner, request_id: int) -> SequenceState:
    seq = SequenceState(request_id)
    runner.pools.admit(seq)
    return seq


def test_the_three_shapes_name_their_sequences_decode_rows_first():
    a, b, c = SequenceState(1), SequenceState(2), SequenceState(3)
    assert ForwardBatch.decode([a, b], [4, 5]).sequences == [a, b]
    assert ForwardBatch.chunk(c, [1, 2, 3], 0, 3, True).sequences == [c]
    mixed = ForwardBatch.mixed([a], [4], PrefillChunk(c, [1, 2, 3], 0, 3, True, capture_at=None))
    assert mixed.sequences == [a, c] and mixed.prefill.length == 3


def test_a_bad_batch_is_refused_before_any_block_is_taken(tiny):
    runner = ModelRunner.build(tiny, num_kv_blocks=8, num_ssm_slots=2)
    seq, other = admitted(runner, 0), admitted(runner, 1)
    for batch, match in [(ForwardBatch(), "at least one decode sequence"),
                         (ForwardBatch.decode([seq], [1, 2]), "2 ids for 1 sequences"),
                         (ForwardBatch.decode([seq], [9999]), "outside the vocabulary"),
                         (ForwardBatch.chunk(seq, [1, 2, 3], 0, 3, True, capture_at=3), "strictly inside"),
                         (ForwardBatch.mixed([SequenceState(5)], [1], PrefillChunk(other, [1, 2], 0, 2, True)),
                          "admit")]:
        with pytest.raises(ValueError, match=match):
            runner.forward(batch)
    assert runner.pools.blocks.num_used == 0 and seq.num_cached_tokens == other.num_cached_tokens == 0


def test_the_output_rows_follow_the_batch(tiny):
    runner = ModelRunner.build(tiny, num_kv_blocks=8, num_ssm_slots=3)
    a, b, late = admitted(runner, 0), admitted(runner, 1), admitted(runner, 2)
    for seq in (a, b):
        runner.prefill_chunk(seq, [3, 4, 5], 0, 3, True)
    out = runner.forward(ForwardBatch.mixed([a, b], [6, 7], PrefillChunk(late, [8, 9, 10, 11], 0, 4, False)))
    assert out.prefill_logits is None and out.capture is None   # not the last chunk: no token 0 yet
    assert tuple(out.decode_logits.shape) == (2, tiny.config.vocab_size)
    assert (a.num_cached_tokens, b.num_cached_tokens, late.num_cached_tokens) == (4, 4, 4)
    last = runner.forward(ForwardBatch.chunk(late, [8, 9, 10, 11, 12], 4, 1, True))
    assert tuple(last.prefill_logits.shape) == (tiny.config.vocab_size,) and last.decode_logits.shape[0] == 0
