"""The MTP layer at run time: its K/V follows every forward exactly, lives in the sequence's blocks,
goes with them, and ``no_mtp_minp`` really drops min-p under mtp."""
from __future__ import annotations

import random

import pytest
import torch

from engine.cache.kv_store import KVStore
from engine.model.batch import build_batch
from engine.model.loader import load_model
from engine.model.mtp import mtp_forward
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from engine.cache.sequence import SequenceState
from telemetry import events as ev
from telemetry.levers import defaults


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = load_model("tiny")
    return model


def reference_mtp_keys(model, tokens: list[int], block_size: int) -> torch.Tensor:
    """The MTP layer's keys for rows p = 0 .. n-2 from one whole-sequence pass: [n-1, Hkv, D]."""
    runner = ModelRunner.build(model, num_kv_blocks=-(-len(tokens) // block_size), num_ssm_slots=1,
                               block_size=block_size)
    seq = SequenceState(request_id=0)
    runner.pools.admit(seq)
    runner.pools.blocks.allocate(seq, len(tokens))
    batch = build_batch((tokens, 0, seq.block_table, seq.ssm_slot), [], block_size, "cpu")
    _, hidden = model(batch, runner.pools.kv_store, runner.pools.ssm, return_hidden=True)  # [n, H]
    layer = model.mtp.kv_layer_ids[0]
    kv = KVStore([layer], runner.pools.kv_store.num_blocks, block_size, model.config.num_key_value_heads,
                 model.config.head_dim)
    rows = build_batch((tokens[1:], 0, seq.block_table, seq.ssm_slot), [], block_size, "cpu")
    mtp_forward(model, rows.token_ids, hidden[:-1], rows, kv)
    return kv.keys[layer].view(-1, *kv.keys[layer].shape[2:])[:len(tokens) - 1]


def test_keep_up_writes_the_mtp_kv_of_a_whole_sequence_pass(tiny):
    block = 4
    rng = random.Random(0)
    prompt = [rng.randrange(32, 127) for _ in range(23)]
    runner = ModelRunner.build(tiny, num_kv_blocks=16, num_ssm_slots=2, block_size=block)
    runner.mtp_keep_up = True
    seq, other = SequenceState(request_id=0), SequenceState(request_id=1)
    runner.pools.admit(seq)
    runner.pools.admit(other)
    runner.prefill_chunk(other, [5, 6, 7], 0, 3, True)
    runner.prefill_chunk(seq, prompt, 0, 10, False)          # two chunks: the row at 9 waits for token 10
    logits = runner.prefill_chunk(seq, prompt, 10, 13, True)
    tokens = list(prompt)
    for _ in range(5):                                        # decode rows batched with another sequence
        tokens.append(int(logits.argmax()))
        logits = runner.decode([other, seq], [9, tokens[-1]])[1]
    # Rows 0 .. n-2 are written (the row at n-1 waits for the next token), in the sequence's blocks.
    n = len(tokens)
    layer = tiny.mtp.kv_layer_ids[0]
    store = runner.pools.kv_store.keys[layer]  # [blocks, block, Hkv, D]
    written = torch.stack([store[seq.block_table[p // block], p % block] for p in range(n - 1)])
    torch.testing.assert_close(written, reference_mtp_keys(tiny, tokens, block), rtol=1e-4, atol=1e-4)
    assert seq.mtp_hidden is not None
    used = runner.pools.blocks.num_used
    runner.pools.release(seq)                                       # preemption and finish both release
    assert seq.mtp_hidden is None and runner.pools.blocks.num_used < used
    runner.pools.blocks.check_invariants()


def test_the_mtp_layer_is_a_kv_layer_counted_in_the_kv_bytes(tiny):
    runner = ModelRunner.build(tiny, num_kv_blocks=8, num_ssm_slots=1)
    assert sorted(runner.pools.kv_store.keys) == tiny.config.full_attention_layers + [tiny.config.num_hidden_layers]
    per_layer = 2 * 8 * 16 * tiny.config.num_key_value_heads * tiny.config.head_dim * 4
    assert runner.pools.kv_store.num_bytes == per_layer * (len(tiny.config.full_attention_layers) + 1)


def run_one(model, levers, sampling):
    rows: list = []
    sched = Scheduler(ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=1), levers, emit=rows.append)
    request = sched.submit(0, [40, 41, 42, 43, 40, 41, 42, 43, 40, 41], sampling)
    while sched.has_work:
        sched.step()
    return request.output_tokens, [r.detail for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"]


def test_no_mtp_minp_drops_min_p_under_mtp_and_the_rows_say_so(tiny):
    sampling = {"max_tokens": 40, "temperature": 1.5, "seed": 3}
    with_min_p = {**sampling, "min_p": 0.3}
    mtp = defaults().replace(speculation="mtp")
    off_plain, _ = run_one(tiny, defaults(), sampling)
    off_min_p, _ = run_one(tiny, defaults(), with_min_p)
    assert off_plain != off_min_p, "min-p must matter for this request, or the test proves nothing"
    dropped, rows = run_one(tiny, mtp.replace(no_mtp_minp=True), with_min_p)
    assert dropped == off_plain                              # min-p not applied, draws otherwise identical
    assert rows and all(d["min_p_off"] and d["min_p_applied"] == 0.0 for d in rows)
    kept, rows = run_one(tiny, mtp, with_min_p)
    assert kept == off_min_p
    assert rows and all(not d["min_p_off"] and d["min_p_applied"] == 0.3 for d in rows)
    _, rows = run_one(tiny, defaults().replace(speculation="ngram", no_mtp_minp=True), with_min_p)
    assert all(not d["min_p_off"] for d in rows)             # only under mtp
