"""Small pure decisions of the loop: who waits for a block (hypothesis invariants), the sibling rules of
n > 1, and the logprobs kept for a request (chunked prompt logprobs equal one pass over the prompt)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.scheduler import logprobs
from engine.scheduler.request import Request
from engine.scheduler.request_features import RequestFeatures
from engine.scheduler.room import rows_that_wait
from engine.scheduler.sampling import SamplingParams
from engine.scheduler.siblings import group_key, keeps_tail_snapshot, tail_ckpt
from telemetry.levers import defaults


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 20)), max_size=12), num_free=st.integers(0, 12))
def test_free_blocks_go_to_the_oldest_rows_that_need_one(rows, num_free):
    needs, ticks = [n for n, _ in rows], [t for _, t in rows]
    waiting = rows_that_wait(needs, ticks, num_free)
    granted = [i for i, n in enumerate(needs) if n and i not in waiting]
    assert waiting == sorted(waiting) and all(needs[i] for i in waiting), "a row needing no block never waits"
    assert len(granted) == min(num_free, sum(needs)), "no block is left idle while a row waits"
    assert all((ticks[g], g) < (ticks[w], w) for g in granted for w in waiting), "the oldest are served first"


def test_rows_wait_only_for_what_they_need():
    assert rows_that_wait([], [], num_free=0) == []
    assert rows_that_wait([1, 1, 1], [2, 2, 1], num_free=2) == [1], "a tie in age goes to the earlier row"


def features(**kw) -> RequestFeatures:
    return RequestFeatures(**kw)


def test_the_first_sibling_keeps_the_tail_snapshot_for_the_others():
    first, second = features(n=3, choice=0), features(n=3, choice=1)
    assert keeps_tail_snapshot(first, prefix_on=True)
    assert not keeps_tail_snapshot(second, prefix_on=True)
    assert not keeps_tail_snapshot(first, prefix_on=False), "no prefix cache: nobody could use the snapshot"
    assert not keeps_tail_snapshot(features(), prefix_on=True), "a lone request"
    assert not keeps_tail_snapshot(features(n=2, prompt_logprobs=0), prefix_on=True), \
        "siblings asking for prompt logprobs take no hit anyway"
    levers = defaults()
    assert not tail_ckpt(levers, second, prefix_on=True)
    assert tail_ckpt(levers.replace(ssm_tail_ckpt=True), second, prefix_on=False), "the lever alone"
    assert tail_ckpt(levers, first, prefix_on=True)


def test_a_sibling_group_is_named_by_its_first_member():
    assert [group_key(rid, 3, choice) for rid, choice in [(10, 0), (11, 1), (12, 2)]] == [10, 10, 10]
    assert group_key(12, 1, 0) == 12


def request_asking(prompt: list[int], *, logprobs_k: int | None = None, prompt_k: int | None = None) -> Request:
    return Request(0, prompt, SamplingParams(), 0, 0,
                   features=RequestFeatures(logprobs=logprobs_k, prompt_logprobs=prompt_k))


def test_a_token_logprob_is_the_raw_log_softmax_with_the_top_k_best_first():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    chosen, top = logprobs.token_logprobs(row, token=2, top_k=3)
    expected = torch.log_softmax(row.double(), dim=-1)
    assert chosen == pytest.approx(float(expected[2]), abs=1e-6)
    assert [i for i, _ in top] == [3, 0, 2]
    assert [v for _, v in top] == pytest.approx(expected[[3, 0, 2]].tolist(), abs=1e-6)
    assert logprobs.token_logprobs(row, token=0, top_k=0)[1] == []
    assert len(logprobs.token_logprobs(row, token=0, top_k=99)[1]) == 5, "k is capped at the vocabulary"
    bf16 = logprobs.token_logprobs(row.bfloat16(), token=3, top_k=1)
    assert bf16[0] == pytest.approx(float(expected[3]), abs=1e-2), "computed in fp32 from a bf16 row"


def test_record_keeps_logprobs_only_for_requests_that_ask():
    row = torch.randn(7, generator=torch.Generator().manual_seed(0))
    silent, asking = request_asking([1, 2]), request_asking([1, 2], logprobs_k=2)
    logprobs.record(silent, row, 4)
    logprobs.record(asking, row, 4)
    assert silent.logprobs == [] and len(asking.logprobs) == 1 and len(asking.logprobs[0][1]) == 2
    assert not logprobs.wants_prompt_logprobs(asking)
    assert logprobs.wants_prompt_logprobs(request_asking([1], prompt_k=0))


@settings(max_examples=40, deadline=None)
@given(prompt_len=st.integers(1, 12), cuts=st.lists(st.integers(1, 5), max_size=6), k=st.integers(0, 3),
       seed=st.integers(0, 1000))
def test_prompt_logprobs_do_not_depend_on_how_the_prompt_was_chunked(prompt_len, cuts, k, seed):
    vocab = 9
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=generator).tolist()
    logits = torch.randn(prompt_len, vocab, generator=generator)          # row j predicts token j + 1
    whole = request_asking(prompt, prompt_k=k)
    logprobs.record_prompt(whole, logits, 0)
    chunked = request_asking(prompt, prompt_k=k)
    offset = 0
    for size in cuts + [prompt_len]:
        if offset >= prompt_len:
            break
        length = min(size, prompt_len - offset)
        logprobs.record_prompt(chunked, logits[offset:offset + length], offset)
        offset += length
    assert len(whole.prompt_logprobs) == prompt_len - 1, "nothing predicts token 0; the last row predicts output"
    assert [[i for i, _ in top] for _, top in chunked.prompt_logprobs] == \
        [[i for i, _ in top] for _, top in whole.prompt_logprobs]
    assert [c for c, _ in chunked.prompt_logprobs] == pytest.approx([c for c, _ in whole.prompt_logprobs], abs=1e-6)
    expected = torch.log_softmax(logits, dim=-1)
    for j, (chosen, top) in enumerate(whole.prompt_logprobs):
        assert chosen == pytest.approx(float(expected[j, prompt[j + 1]]), abs=1e-5)
        assert len(top) == min(k, vocab) and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
