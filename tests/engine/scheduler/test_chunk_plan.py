"""Chunk planner: every cap and rule of the reference, edge cases, and tiling invariants."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.scheduler.chunk_plan import plan_all_chunks, plan_chunk, ssm_tail_boundary
from telemetry.events import (
    CAP_BLOCK_ALIGN,
    CAP_MAX_PREFILL,
    CAP_REMAINING,
    CAP_SLICE_BUDGET,
    CAP_SSM_TAIL,
    CAP_TAIL_SPLIT,
    CAP_WHOLE_PROMPT,
)

BASE = dict(max_prefill_tokens=64, slice_budget=None, is_mla=False, block_size=16,
            ssm_tail_ckpt=False, ssm_tail_midchunk=False, tail_split=None)


def plan(prompt_len, offset=0, **over):
    return plan_chunk(prompt_len=prompt_len, offset=offset, **{**BASE, **over})


# (name, prompt_len, offset, overrides, expected (length, is_last, rule, tail boundary))
CASES = [
    ("fits under every cap", 40, 0, {}, (40, True, CAP_REMAINING, None)),
    ("max prefill, aligned", 100, 0, dict(max_prefill_tokens=32), (32, False, CAP_MAX_PREFILL, None)),
    ("max prefill then align down", 100, 0, dict(max_prefill_tokens=40), (32, False, CAP_BLOCK_ALIGN, None)),
    ("slice budget", 100, 0, dict(slice_budget=48), (48, False, CAP_SLICE_BUDGET, None)),
    ("slice budget then align", 100, 0, dict(slice_budget=20), (16, False, CAP_BLOCK_ALIGN, None)),
    ("slice budget above max prefill", 100, 0, dict(max_prefill_tokens=32, slice_budget=64),
     (32, False, CAP_MAX_PREFILL, None)),
    ("slice budget equal to max prefill credits max prefill", 100, 0, dict(max_prefill_tokens=32, slice_budget=32),
     (32, False, CAP_MAX_PREFILL, None)),
    ("last chunk under slice budget", 100, 96, dict(slice_budget=8), (4, True, CAP_REMAINING, None)),
    ("MLA takes the whole remainder", 100, 0, dict(is_mla=True, max_prefill_tokens=32, slice_budget=16),
     (100, True, CAP_WHOLE_PROMPT, None)),
    ("MLA ignores slice budget alone", 100, 0, dict(is_mla=True, max_prefill_tokens=128, slice_budget=16),
     (100, True, CAP_WHOLE_PROMPT, None)),
    ("MLA short prompt", 10, 0, dict(is_mla=True), (10, True, CAP_REMAINING, None)),
    ("MLA is never cut at the SSM tail; the boundary stays in force (captured inside)", 100, 0,
     dict(is_mla=True, ssm_tail_ckpt=True), (100, True, CAP_WHOLE_PROMPT, 96)),
    ("MLA with mla_chunked_prefill chunks like any model", 100, 0,
     dict(is_mla=True, mla_chunked_prefill=True, max_prefill_tokens=40), (32, False, CAP_BLOCK_ALIGN, None)),
    ("MLA with mla_chunked_prefill takes the slice budget", 100, 0,
     dict(is_mla=True, mla_chunked_prefill=True, slice_budget=48), (48, False, CAP_SLICE_BUDGET, None)),
    ("MLA with mla_chunked_prefill is cut at the SSM tail", 100, 64,
     dict(is_mla=True, mla_chunked_prefill=True, ssm_tail_ckpt=True), (32, False, CAP_SSM_TAIL, 96)),
    ("mla_chunked_prefill on a GQA model changes nothing", 100, 0,
     dict(mla_chunked_prefill=True, max_prefill_tokens=32), (32, False, CAP_MAX_PREFILL, None)),
    ("SSM tail cut", 100, 64, dict(ssm_tail_ckpt=True), (32, False, CAP_SSM_TAIL, 96)),
    ("SSM tail: mid-chunk capture on, no cut, the boundary still on the row", 100, 64,
     dict(ssm_tail_ckpt=True, ssm_tail_midchunk=True), (36, True, CAP_REMAINING, 96)),
    ("SSM tail: mid-chunk capture without the lever does nothing", 100, 64, dict(ssm_tail_midchunk=True),
     (36, True, CAP_REMAINING, None)),
    ("SSM tail lever off", 100, 64, {}, (36, True, CAP_REMAINING, None)),
    ("SSM tail: chunk ends exactly on it", 100, 0, dict(ssm_tail_ckpt=True, max_prefill_tokens=96),
     (96, False, CAP_MAX_PREFILL, 96)),
    ("SSM tail: offset already on it", 100, 96, dict(ssm_tail_ckpt=True), (4, True, CAP_REMAINING, 96)),
    ("SSM tail: prompt an exact multiple of the block", 64, 0, dict(ssm_tail_ckpt=True, max_prefill_tokens=128),
     (48, False, CAP_SSM_TAIL, 48)),
    ("SSM tail: prompt within one block has none", 16, 0, dict(ssm_tail_ckpt=True), (16, True, CAP_REMAINING, None)),
    ("no block size: no tail cut, no alignment", 100, 0,
     dict(block_size=None, ssm_tail_ckpt=True, max_prefill_tokens=40), (40, False, CAP_MAX_PREFILL, None)),
    ("tail split spanned", 100, 0, dict(tail_split=50), (50, False, CAP_TAIL_SPLIT, None)),
    ("tail split without a block size", 100, 0, dict(block_size=None, tail_split=50),
     (50, False, CAP_TAIL_SPLIT, None)),
    ("chunk ending on the tail split keeps it", 100, 0, dict(max_prefill_tokens=40, tail_split=40),
     (40, False, CAP_MAX_PREFILL, None)),
    ("tail split behind the offset is ignored", 100, 32, dict(max_prefill_tokens=40, tail_split=20),
     (32, False, CAP_BLOCK_ALIGN, None)),
    ("tail split at the offset is ignored", 100, 50, dict(max_prefill_tokens=40, tail_split=50),
     (30, False, CAP_BLOCK_ALIGN, None)),
    ("tail split beyond the chunk", 100, 0, dict(max_prefill_tokens=40, tail_split=90),
     (32, False, CAP_BLOCK_ALIGN, None)),
    ("last chunk is never split", 30, 0, dict(tail_split=10), (30, True, CAP_REMAINING, None)),
    ("SSM tail cut, then tail split inside it", 100, 64, dict(ssm_tail_ckpt=True, tail_split=80),
     (16, False, CAP_TAIL_SPLIT, 96)),
    ("unaligned offset reaches the next boundary", 100, 50, dict(max_prefill_tokens=40),
     (30, False, CAP_BLOCK_ALIGN, None)),
    ("unaligned offset, cap short of the next boundary: unaligned, >= 1 token", 100, 50,
     dict(max_prefill_tokens=8), (8, False, CAP_MAX_PREFILL, None)),
    ("cap smaller than a block", 100, 0, dict(max_prefill_tokens=8), (8, False, CAP_MAX_PREFILL, None)),
    ("one token left", 100, 99, {}, (1, True, CAP_REMAINING, None)),
]


@pytest.mark.parametrize("name, prompt_len, offset, over, expected", CASES, ids=[c[0] for c in CASES])
def test_plan_table(name, prompt_len, offset, over, expected):
    got = plan(prompt_len, offset, **over)
    assert (got.length, got.is_last, got.cap_rule, got.ssm_tail_boundary) == expected


@pytest.mark.parametrize("prompt_len, block, expected", [
    (40, 16, 32), (32, 16, 16), (33, 16, 32), (17, 16, 16), (16, 16, None), (10, 16, None),
    (1, 1, None), (5, 1, 4),
])
def test_ssm_tail_boundary(prompt_len, block, expected):
    assert ssm_tail_boundary(prompt_len, block) == expected


@pytest.mark.parametrize("over, match", [
    (dict(prompt_len=0), "prompt_len"),
    (dict(offset=100), "offset"),
    (dict(offset=-1), "offset"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens"),
    (dict(slice_budget=0), "slice_budget"),
    (dict(block_size=0), "block_size"),
    (dict(tail_split=-3), "tail_split"),
])
def test_bad_inputs_name_the_field(over, match):
    args = {**BASE, "prompt_len": 100, "offset": 0, **over}
    with pytest.raises(ValueError, match=match):
        plan_chunk(**args)
    if match == "block_size":
        with pytest.raises(ValueError, match="block_size"):
            ssm_tail_boundary(10, 0)


@pytest.mark.parametrize("slice_budget, remaining, ignored", [(16, 100, True), (None, 100, False), (128, 100, False)])
def test_the_whole_prompt_rule_says_when_it_ran_past_the_slice_budget(slice_budget, remaining, ignored):
    chunk = plan(remaining, is_mla=True, slice_budget=slice_budget, max_prefill_tokens=512)
    assert (chunk.length, chunk.slice_budget_ignored) == (remaining, ignored)
    assert plan(remaining, slice_budget=slice_budget).slice_budget_ignored is False  # never outside the rule
    assert plan(remaining, is_mla=True, mla_chunked_prefill=True, slice_budget=slice_budget).slice_budget_ignored \
        is False


def test_plan_all_chunks_tiles_a_prompt():
    chunks = plan_all_chunks(prompt_len=100, **{**BASE, "max_prefill_tokens": 40, "ssm_tail_ckpt": True})
    assert [(o, p.length, p.cap_rule) for o, p in chunks] == [
        (0, 32, CAP_BLOCK_ALIGN), (32, 32, CAP_BLOCK_ALIGN), (64, 32, CAP_SSM_TAIL), (96, 4, CAP_REMAINING)]
    assert [p.is_last for _, p in chunks] == [False, False, False, True]


RULES = st.fixed_dictionaries(dict(
    max_prefill_tokens=st.integers(1, 200),
    slice_budget=st.none() | st.integers(1, 200),
    is_mla=st.booleans(),
    mla_chunked_prefill=st.booleans(),
    block_size=st.none() | st.integers(1, 64),
    ssm_tail_ckpt=st.booleans(),
    ssm_tail_midchunk=st.booleans(),
    tail_split=st.none() | st.integers(0, 700),
))


@settings(max_examples=400, deadline=None)
@given(prompt_len=st.integers(1, 600), rules=RULES)
def test_planning_from_zero_tiles_the_prompt(prompt_len, rules):
    chunks = plan_all_chunks(prompt_len=prompt_len, **rules)  # terminates: every chunk is >= 1 token
    assert chunks[0][0] == 0
    assert sum(p.length for _, p in chunks) == prompt_len
    assert [p.is_last for _, p in chunks] == [False] * (len(chunks) - 1) + [True]
    cap = min(rules["max_prefill_tokens"], rules["slice_budget"] or rules["max_prefill_tokens"])
    bs = rules["block_size"]
    in_force = rules["ssm_tail_ckpt"] and bs is not None
    tail = ssm_tail_boundary(prompt_len, bs) if in_force else None
    cut = tail if not rules["ssm_tail_midchunk"] else None   # mid-chunk capture never cuts
    if rules["is_mla"] and not rules["mla_chunked_prefill"]:
        assert len(chunks) == 1 and chunks[0][1].ssm_tail_boundary == tail
        return
    ends = set()
    for offset, p in chunks:
        assert 1 <= p.length <= cap
        end = offset + p.length
        ends.add(end)
        assert p.ssm_tail_boundary == tail
        if p.is_last:
            continue
        on_block = bs is not None and end % bs == 0
        at_marks = end in (cut, rules["tail_split"])
        # The only other way to end: the cap itself stopped short of the next boundary.
        cap_short = p.length == cap and (bs is None or (offset // bs + 1) * bs > end)
        assert on_block or at_marks or cap_short, (offset, p)
    if cut is not None:
        assert cut in ends  # the SSM snapshot lands where the next turn's prefix match stops
