"""The plan of a tick (``plan_tick``) on plain values: which kind of tick runs, the chunk and its caps,
the mix verdict, the dropped drafts and the decode rows; and that planning changes nothing."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.grammar.masks import MaskStats
from engine.scheduler.adaptive import StructureTokens
from engine.scheduler.chunk_plan import plan_chunk
from engine.scheduler.context import ModelTraits, TickContext
from engine.scheduler.mixing import can_mix
from engine.scheduler.plan import KIND_CHUNK, KIND_DECODE, KIND_IDLE, decode_rows, plan_tick
from engine.scheduler.queues import Queues
from engine.scheduler.request_features import RequestFeatures
from telemetry import events as ev
from telemetry.levers import defaults

BS = 16


def traits(*, is_ep: bool = False, is_mla: bool = False) -> ModelTraits:
    return ModelTraits(eos_ids=frozenset({0}), max_context=4096, vocab_size=272, block_size=BS, is_mla=is_mla,
                       is_ep=is_ep, has_linear_attention=True, structure_tokens=StructureTokens(None, None, None),
                       think_end_id=None, tool_call_start_id=None, prefill_tail_split=lambda tokens: None,
                       detokenize=None)


def context(levers, last_path: str, **kw) -> TickContext:
    return TickContext(7, levers, traits(**kw), None, None, lambda: 0, None, last_path, MaskStats())


def decoding(request_id: int, slot: int | None, drafts: int = 0):
    return SimpleNamespace(request_id=request_id, seq=SimpleNamespace(ssm_slot=slot), pending_drafts=[1] * drafts)


def prefilling(prompt_len: int, offset: int, features: RequestFeatures = RequestFeatures()):
    return SimpleNamespace(request_id=99, prompt_len=prompt_len, chunk_offset=offset,
                           prompt_tokens=list(range(prompt_len)), features=features,
                           seq=SimpleNamespace(images=None))   # a text prompt (image caps: test_vision_scheduling.py)


def queues_of(active, prefill) -> Queues:
    queues = Queues()
    queues.active, queues.prefilling = list(active), prefill
    return queues


levers_st = st.builds(
    lambda no_mix, spec, mixed, budget, cap, ckpt, mid: defaults().replace(
        bisect_no_mix=no_mix, speculation=spec, always_mixed=mixed, slice_budget=budget, max_prefill_tokens=cap,
        ssm_tail_ckpt=ckpt, ssm_tail_midchunk=mid),
    st.booleans(), st.sampled_from(["off", "ngram"]), st.booleans(), st.integers(8, 128), st.integers(8, 256),
    st.booleans(), st.booleans())


@settings(max_examples=200, deadline=None)
@given(levers=levers_st, num_active=st.integers(0, 5), slots=st.lists(st.one_of(st.none(), st.integers(0, 9)),
       min_size=5, max_size=5), drafts=st.lists(st.integers(0, 3), min_size=5, max_size=5),
       prompt=st.one_of(st.none(), st.tuples(st.integers(1, 600), st.integers(0, 599))),
       last_path=st.sampled_from([ev.PATH_IDLE, ev.PATH_PREFILL, ev.PATH_MIXED, ev.PATH_DECODE]),
       is_ep=st.booleans(), prefix_on=st.booleans())
def test_the_plan_follows_the_rules_and_changes_nothing(levers, num_active, slots, drafts, prompt, last_path,
                                                         is_ep, prefix_on):
    active = [decoding(i, slots[i], drafts[i]) for i in range(num_active)]
    prefill = None if prompt is None else prefilling(prompt[0], min(prompt[1], prompt[0] - 1) // BS * BS)
    queues = queues_of(active, prefill)
    order_before = [a.request_id for a in queues.active]
    pools = SimpleNamespace(prefix=object() if prefix_on else None)
    plan = plan_tick(context(levers, last_path, is_ep=is_ep), queues, pools)
    assert [a.request_id for a in queues.active] == order_before
    assert [len(a.pending_drafts) for a in active] == drafts[:num_active]
    owed = last_path == ev.PATH_PREFILL and bool(active)
    if prefill is None and not active:
        assert plan.kind == KIND_IDLE
        return
    if prefill is None or owed:
        assert plan.kind == KIND_DECODE and plan.chunk is None
        assert list(plan.decode_rows) == decode_rows(active)
        return
    assert plan.kind == KIND_CHUNK and plan.chunk.request is prefill
    assert plan.chunk.chunk == plan_chunk(
        prompt_len=prefill.prompt_len, offset=prefill.chunk_offset, max_prefill_tokens=levers.max_prefill_tokens,
        slice_budget=levers.slice_budget if levers.always_mixed else None, is_mla=False, block_size=BS,
        ssm_tail_ckpt=levers.ssm_tail_ckpt, ssm_tail_midchunk=levers.ssm_tail_midchunk, tail_split=None)
    verdict = can_mix(bisect_no_mix=levers.bisect_no_mix, num_active=len(active), is_ep=is_ep,
                      speculation=levers.speculation)
    assert plan.chunk.verdict == verdict
    if verdict.can_mix:
        assert list(plan.decode_rows) == decode_rows(active)
        assert plan.chunk.drop.num_dropped == (sum(drafts[:num_active]) if levers.speculation != "off" else 0)
    else:
        assert plan.decode_rows == () and plan.chunk.drop is None
    capture = plan.chunk.capture_at
    if capture is not None:
        assert prefix_on and levers.ssm_tail_ckpt and levers.ssm_tail_midchunk
        assert prefill.chunk_offset < capture < prefill.chunk_offset + plan.chunk.chunk.length


def test_decodes_are_owed_the_tick_after_a_plain_chunk():
    queues = queues_of([decoding(1, 0)], prefilling(100, 0))
    levers = defaults().replace(bisect_no_mix=True)
    assert plan_tick(context(levers, ev.PATH_PREFILL), queues, SimpleNamespace(prefix=None)).kind == KIND_DECODE
    chunk = plan_tick(context(levers, ev.PATH_DECODE), queues, SimpleNamespace(prefix=None))
    assert chunk.kind == KIND_CHUNK and chunk.chunk.verdict.blocker == ev.BLOCK_BISECT
    assert plan_tick(context(defaults(), ev.PATH_MIXED), queues, SimpleNamespace(prefix=None)).chunk.verdict.can_mix


def test_an_mla_prompt_is_never_split():
    queues = queues_of([], prefilling(700, 0))
    plan = plan_tick(context(defaults(), ev.PATH_IDLE, is_mla=True), queues, SimpleNamespace(prefix=None))
    assert plan.chunk.chunk.length == 700 and plan.chunk.chunk.cap_rule == ev.CAP_WHOLE_PROMPT


def test_the_first_of_n_siblings_cuts_at_its_tail_boundary_with_the_lever_off():
    """Its siblings' prefix hits need the snapshot there (engine/scheduler/siblings.py)."""
    levers = defaults().replace(ssm_tail_ckpt=False, max_prefill_tokens=512)
    first, second = (RequestFeatures(n=3, choice=c) for c in (0, 1))
    for features, prefix_on, boundary in ((first, True, 32), (second, True, None), (first, False, None)):
        queues = SimpleNamespace(prefilling=prefilling(40, 0, features), active=[])
        plan = plan_tick(context(levers, ev.PATH_IDLE), queues, SimpleNamespace(prefix=object() if prefix_on else None))
        assert plan.chunk.chunk.ssm_tail_boundary == boundary
        assert plan.chunk.chunk.length == (32 if boundary else 40)
