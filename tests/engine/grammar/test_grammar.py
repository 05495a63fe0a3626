"""engine/grammar on its own: specs, the compile worker and its cache, matchers (mask, advance, rollback), masks."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.grammar import masks
from engine.grammar.compiler import GrammarCompileError, GrammarCompiler, build_ll_tokenizer
from engine.grammar.matcher import unpack_bits
from engine.grammar.spec import GrammarSpec, GrammarSpecError
from engine.model.tokenizer import EOS, THINK_END, build_byte_tokenizer

VOCAB = 272
INNER = build_byte_tokenizer()
EOS_ID, THINK_END_ID = INNER.token_to_id(EOS), INNER.token_to_id(THINK_END)


@pytest.fixture(scope="module")
def compiler():
    c = GrammarCompiler(build_ll_tokenizer(INNER, VOCAB, {EOS_ID}), think_end_id=THINK_END_ID)
    yield c
    c.close()


def state_for(compiler, raw):
    return compiler.new_state(compiler.compile_now(GrammarSpec.parse(raw), timeout_s=30))


def allowed_ids(state) -> list[int]:
    mask = state.allowed_mask()
    return torch.nonzero(mask).flatten().tolist()


@pytest.mark.parametrize("raw, message", [
    ("regex", "must be an object"),
    ({"kind": "xml", "value": "a"}, "grammar.kind must be one of"),
    ({"kind": "regex", "value": ""}, "non-empty string"),
    ({"kind": "choice", "value": []}, "non-empty list"),
    ({"kind": "choice", "value": ["a", 3]}, "non-empty list"),
    ({"kind": "json_schema", "value": "{not json"}, "not valid JSON"),
    ({"kind": "json_schema", "value": [1]}, "must be an object"),
    ({"kind": "regex", "value": "a", "flags": "i"}, "unknown field"),
    ({"kind": "regex", "value": "a", "after_think": "yes"}, "after_think"),
])
def test_bad_specs_name_the_field(raw, message):
    with pytest.raises(GrammarSpecError, match=message):
        GrammarSpec.parse(raw)


def test_spec_round_trips_and_keys_by_canonical_text():
    a = GrammarSpec.parse({"kind": "json_schema", "value": '{"type": "object", "required": []}'})
    b = GrammarSpec.parse({"kind": "json_schema", "value": {"required": [], "type": "object"}})
    assert a.cache_key == b.cache_key
    assert GrammarSpec.parse(a.to_dict()) == a
    assert GrammarSpec.parse({"kind": "json_object", "value": "ignored"}).to_dict() == {"kind": "json_object", "value": None}


def test_compiles_on_the_worker_and_caches_by_text(compiler):
    spec = GrammarSpec.parse({"kind": "regex", "value": "cache-[0-9]{3}"})
    future = compiler.submit(spec)
    assert future.result(timeout=30).spec == spec
    hits = compiler.num_cache_hits
    assert compiler.submit(GrammarSpec.parse({"kind": "regex", "value": "cache-[0-9]{3}"})) is future
    assert compiler.num_cache_hits == hits + 1
    seen = []
    compiler._pool.submit(lambda: seen.append(threading.current_thread().name)).result()
    assert seen[0].startswith("grammar-compile") and seen[0] != threading.current_thread().name


def test_cache_is_bounded():
    c = GrammarCompiler(build_ll_tokenizer(INNER, VOCAB, {EOS_ID}), max_entries=3)
    try:
        for i in range(8):
            c.compile_now(GrammarSpec.parse({"kind": "regex", "value": f"x{i}"}), timeout_s=30)
        assert len(c._cache) <= 3
    finally:
        c.close()


@pytest.mark.parametrize("raw, message", [
    ({"kind": "regex", "value": "[("}, "unclosed character class"),
    ({"kind": "lark", "value": "start: foo"}, "foo"),
    ({"kind": "json_schema", "value": {"type": "nonsense"}}, "nonsense"),
])
def test_compile_errors_name_the_problem(compiler, raw, message):
    with pytest.raises(GrammarCompileError, match=message):
        compiler.compile_now(GrammarSpec.parse(raw), timeout_s=30)


def test_mask_advance_stop_and_eos_only_when_accepting(compiler):
    state = state_for(compiler, {"kind": "regex", "value": "ab?c*"})
    assert allowed_ids(state) == [ord("a")]
    assert state.advance(ord("a")) and state.is_accepting and not state.is_stopped
    assert set(allowed_ids(state)) == {ord("b"), ord("c"), EOS_ID}   # complete: EOS allowed
    state.advance(ord("b"))
    assert state.advance(ord("c")) and not state.is_stopped
    assert not state.advance(ord("z")) and "z" in state.failure or state.failure


def test_choice_stops_when_complete(compiler):
    state = state_for(compiler, {"kind": "choice", "value": ["yes", "no"]})
    assert set(allowed_ids(state)) == {ord("y"), ord("n")}
    for byte in b"no":
        assert state.advance(byte)
    assert state.is_stopped and state.is_accepting


def test_after_think_is_dormant_until_think_end(compiler):
    state = state_for(compiler, {"kind": "choice", "value": ["ok"], "after_think": True})
    assert state.allowed_mask() is None and not state.is_active
    assert state.num_valid_prefix([1, 2, THINK_END_ID, ord("o"), ord("x")]) == 4
    for token in (5, 6, THINK_END_ID):
        assert state.advance(token)
    assert state.is_active and allowed_ids(state) == [ord("o")]
    state.rollback(1)
    assert not state.is_active and state.allowed_mask() is None


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(list(b"abc")), min_size=1, max_size=12), st.data())
def test_rollback_restores_the_exact_masks(compiler, tokens, data):
    """Advancing k tokens and rolling back n gives the masks a fresh matcher has after k - n."""
    state = state_for(compiler, {"kind": "regex", "value": "(ab|ac|b)*c?"})
    taken = []
    for token in tokens:
        if token not in allowed_ids(state):
            break
        assert state.advance(token)
        taken.append(token)
    num_back = data.draw(st.integers(0, len(taken)))
    state.rollback(num_back)
    fresh = state_for(compiler, {"kind": "regex", "value": "(ab|ac|b)*c?"})
    for token in taken[:len(taken) - num_back]:
        fresh.advance(token)
    assert allowed_ids(state) == allowed_ids(fresh)
    assert state.num_valid_prefix(taken[len(taken) - num_back:]) == num_back


def test_unpack_bits_matches_token_order():
    words = np.array([[0b1011, -(1 << 31), 0]], dtype=np.int32)           # tokens 0, 1, 3 and 63 (sign bit)
    assert torch.nonzero(unpack_bits(words, 80)[0]).flatten().tolist() == [0, 1, 3, 63]


def test_constrain_masks_only_constrained_rows(compiler):
    logits = torch.randn(3, VOCAB)                                           # [B, V]
    state = state_for(compiler, {"kind": "regex", "value": "[xy]z"})
    out, stats = masks.constrain(logits, [None, state, None])
    assert stats.num_rows == 1 and stats.mask_ns > 0
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = torch.nonzero(torch.isfinite(out[1])).flatten().tolist()
    assert finite == [ord("x"), ord("y")]
    assert torch.equal(out[1, finite], logits[1, finite])
    same, no_stats = masks.constrain(logits, [None, None, None])
    assert same is logits and no_stats.num_rows == 0


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}]


def test_tool_call_grammar_takes_exactly_one_call_to_a_listed_tool(compiler):
    from engine.grammar.tools import tool_call_spec
    start, end = INNER.token_to_id("<tool_call>"), INNER.token_to_id("</tool_call>")
    state = state_for(compiler, tool_call_spec(TOOLS, start_id=start, end_id=end).to_dict())
    assert allowed_ids(state) == [start]
    for token in [start, *b'\n{"name":"add","arguments":{"a":1,"b":-2}}\n', end]:
        assert state.advance(token), state.failure
    assert state.is_stopped and state.is_accepting
    named = state_for(compiler, tool_call_spec(TOOLS, start_id=start, end_id=end, name="get_weather").to_dict())
    assert named.num_valid_prefix([start, *b'\n{"name":"a']) == 1 + len(b'\n{"name":"')


def test_tool_call_grammar_refuses_unknown_names_and_bad_tools():
    from engine.grammar.tools import tool_call_spec
    with pytest.raises(GrammarSpecError, match="not among the request's tools"):
        tool_call_spec(TOOLS, start_id=1, end_id=2, name="nope")
    with pytest.raises(GrammarSpecError, match="string name"):
        tool_call_spec([{"type": "function", "function": {}}], start_id=1, end_id=2)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
def test_the_mask_allows_exactly_the_tokens_the_matcher_takes(compiler, picks):
    """At every step the mask's allowed set equals the tokens the matcher would consume."""
    state = state_for(compiler, {"kind": "json_schema", "value": {
        "type": "object", "properties": {"k": {"enum": ["ab", "ac"]}, "n": {"type": "integer", "maximum": 99}},
        "required": ["k", "n"], "additionalProperties": False}})
    for pick in picks:
        allowed = set(allowed_ids(state))
        # EOS is allowed exactly where the grammar accepts (llguidance's validate never counts EOS).
        assert (EOS_ID in allowed) == state.is_accepting
        assert allowed - {EOS_ID} == {t for t in range(VOCAB) if state.num_valid_prefix([t]) == 1}
        if state.is_stopped:
            break
        ordered = sorted(allowed)
        assert state.advance(ordered[pick % len(ordered)])


def test_a_cached_compile_waits_for_think_end_only_when_the_request_that_reuses_it_thinks(compiler):
    """The cache key leaves ``after_think`` out: a thinking request that hits a compile made for one
    without thinking must still let its thought run free (it failed at token 0 before)."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 7, "maximum": 9}, "maxItems": 2}
    plain = GrammarSpec.parse({"kind": "json_schema", "value": schema})
    thinking = GrammarSpec.parse({"kind": "json_schema", "value": schema, "after_think": True})
    compiled = compiler.compile_now(plain, timeout_s=30)
    hits = compiler.num_cache_hits
    reused = compiler.compile_now(thinking, timeout_s=30)
    assert reused is compiled and compiler.num_cache_hits == hits + 1
    state = compiler.new_state(reused, thinking)
    assert state.spec.after_think and state.allowed_mask() is None      # dormant: the thought is free
    assert state.advance(INNER.token_to_id("T")) and state.advance(THINK_END_ID) and state.is_active
    assert compiler.new_state(reused, plain).allowed_mask() is not None   # the plain one constrains token 0
