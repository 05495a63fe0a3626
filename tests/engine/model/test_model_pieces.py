"""Small model-side pieces on their own: the packed batch layout (hypothesis), the fault hook's text and
its arming on the tiny model, and the tokenizer (byte-level round trip, special ids, a broken file)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.model.batch import build_batch
from engine.model.errors import CheckpointError
from engine.model.fault import ENV_VAR, FORWARD_KINDS, ForwardFault, InjectedFault
from engine.model.loader import load_model
from engine.model.tokenizer import (
    CHAT_TOKENS,
    CODE_FENCE,
    EOS,
    SPECIAL_TOKENS,
    THINK_END,
    Tokenizer,
    build_byte_tokenizer,
    load_tokenizer,
)

BLOCK = 4


@st.composite
def forwards(draw):
    """A prefill chunk and decode rows over disjoint block tables, as the block manager hands them out."""
    free = iter(draw(st.permutations(range(1, 64))))
    prefill = None
    if draw(st.booleans()):
        start, length = draw(st.integers(0, 20)), draw(st.integers(1, 12))
        table = [next(free) for _ in range(-(-(start + length) // BLOCK))]
        prefill = (draw(st.lists(st.integers(0, 99), min_size=length, max_size=length)), start, table,
                   draw(st.integers(0, 7)))
    decodes = []
    for _ in range(draw(st.integers(0 if prefill else 1, 4))):
        pos = draw(st.integers(0, 30))
        decodes.append((draw(st.integers(0, 99)), pos, [next(free) for _ in range(pos // BLOCK + 1)],
                        draw(st.integers(0, 7))))
    return prefill, decodes


@settings(max_examples=80, deadline=None)
@given(forward=forwards())
def test_a_packed_batch_puts_every_token_in_its_own_cache_slot(forward):
    prefill, decodes = forward
    batch = build_batch(prefill, decodes, BLOCK)
    rows = ([(t, prefill[1] + i, prefill[2]) for i, t in enumerate(prefill[0])] if prefill else []) + \
        [(t, pos, table) for t, pos, table, _ in decodes]
    assert batch.num_tokens == len(rows) == batch.positions.numel() == batch.kv_slots.numel()
    assert batch.token_ids.tolist() == [t for t, _, _ in rows]
    assert batch.positions.tolist() == [p for _, p, _ in rows]
    assert batch.kv_slots.tolist() == [table[p // BLOCK] * BLOCK + p % BLOCK for _, p, table in rows]
    assert len(set(batch.kv_slots.tolist())) == len(rows), "no two tokens write one slot"
    if prefill is None:
        assert batch.prefill is None and batch.num_prefill_tokens == 0
    else:
        assert batch.num_prefill_tokens == len(prefill[0]) and batch.prefill.block_ids.tolist() == prefill[2]
    if not decodes:
        assert batch.decode is None
        return
    group = batch.decode
    assert group.context_lens.tolist() == [pos + 1 for _, pos, _, _ in decodes]
    # Each row sees exactly its own context; padded block-table entries are never visible.
    assert group.visible.sum(dim=-1).flatten().tolist() == group.context_lens.tolist()
    for row, (_, pos, table, _) in enumerate(decodes):
        assert group.block_tables[row, : len(table)].tolist() == table
        assert not group.block_tables[row, len(table):].any()
    slots = [slot for *_, slot in decodes]
    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
    assert group.slot_range == ((slots[0], slots[0] + len(slots)) if consecutive else None)


def test_fault_text_parses_merges_and_describes_itself():
    fault = ForwardFault.parse(" 7, 12:decode,15:prefill+mixed, 12:prefill ,")
    assert fault.targets == {7: frozenset(FORWARD_KINDS), 12: frozenset({"decode", "prefill"}),
                             15: frozenset({"prefill", "mixed"})}
    assert fault.describe() == "7:prefill+mixed+decode,12:prefill+decode,15:prefill+mixed"
    assert ForwardFault.parse(fault.describe()) == fault, "the description replays the same hook"
    assert fault.culprit("decode", [3, 15, 12, 7]) == 12
    assert fault.culprit("mixed", [3, 12]) is None
    assert ForwardFault.from_env({ENV_VAR: "  "}) is None and ForwardFault.from_env({}) is None
    assert ForwardFault.from_env({ENV_VAR: "4"}).targets == {4: frozenset(FORWARD_KINDS)}


@pytest.mark.parametrize("text, words", [
    ("x", "does not start with a request id"),
    ("3:sideways", "unknown forward kind(s) ['sideways']"),
    (" , ", "names no request id"),
])
def test_bad_fault_text_is_one_value_error_naming_it(text, words):
    with pytest.raises(ValueError) as info:
        ForwardFault.parse(text)
    assert words in str(info.value) and ENV_VAR in str(info.value)


def test_an_armed_fault_fails_only_its_forward_and_leaves_no_hook_behind():
    model = load_model("tiny")[0]
    last = model.model.layers[-1]
    fault = ForwardFault.parse("5:decode")
    with fault.armed(model, "prefill", [5]):
        assert not last._forward_pre_hooks, "no target in this forward kind: no hook at all"
    with pytest.raises(InjectedFault, match="decode forward carrying request 5"):
        with fault.armed(model, "decode", [4, 5]):
            assert len(last._forward_pre_hooks) == 1
            last(torch.zeros(1), None)  # any call of the last layer trips it before the layer runs
    assert not last._forward_pre_hooks, "the hook is removed even when the forward raised"


BYTES = build_byte_tokenizer()


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_the_byte_tokenizer_round_trips_any_text_one_id_per_byte(text):
    tokenizer = Tokenizer(BYTES)
    ids = tokenizer.encode(text)
    if not any(token in text for token in (*SPECIAL_TOKENS, *CHAT_TOKENS, CODE_FENCE)):
        assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_special_tokens_follow_the_bytes_in_a_fixed_order():
    tokenizer = Tokenizer(BYTES)
    ordered = [*SPECIAL_TOKENS, CODE_FENCE, *CHAT_TOKENS]
    assert [tokenizer.token_id(t) for t in ordered] == list(range(256, 256 + len(ordered)))
    assert tokenizer.vocab_size == 256 + len(ordered)
    assert tokenizer.encode(f"a{THINK_END}b```") == [ord("a"), tokenizer.token_id(THINK_END), ord("b"),
                                                    tokenizer.token_id(CODE_FENCE)]

    class Model:
        pass

    model = Model()
    tokenizer.assign_special_ids(model)
    assert model.eos_token_id == tokenizer.token_id(EOS) and model.code_fence_id == tokenizer.token_id(CODE_FENCE)


def test_a_checkpoint_tokenizer_is_optional_but_a_broken_one_is_named(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: unreadable tokenizer"):
        load_tokenizer(tmp_path)
    BYTES.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hi") == [ord("h"), ord("i")]
