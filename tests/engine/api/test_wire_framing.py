"""The socket framing between the engine and its API frontend: however the bytes arrive (any split, any
number of messages per read), ``unframe`` hands back exactly the framed messages in order and keeps a
partial one; a length no real peer sends is PeerGone, not an allocation of it."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.api.wire import HEADER, MAX_MESSAGE_BYTES, Batch, Cancel, Ended, PeerGone, Submit, Tokens, frame, unframe
from engine.scheduler.request_features import RequestFeatures

MESSAGES = st.one_of(
    st.builds(Batch, tokens=st.lists(st.tuples(st.integers(0, 99), st.lists(st.integers(0, 300), max_size=4),
                                               st.just([])), max_size=3),
              num_waiting=st.integers(0, 50), num_drained=st.integers(0, 50)),
    st.lists(st.integers(), max_size=5),
    st.text(max_size=30),
    st.binary(max_size=40),
)


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(MESSAGES, max_size=6), cuts=st.lists(st.integers(1, 64), max_size=20))
def test_messages_come_back_whole_and_in_order_however_the_bytes_are_split(messages, cuts):
    stream = b"".join(frame(m) for m in messages)
    buffer, received, at = bytearray(), [], 0
    for size in cuts + [len(stream)]:
        buffer += stream[at:at + size]
        at += size
        received += unframe(buffer)
    assert received == messages
    assert buffer == bytearray(), "nothing is left once every byte arrived"


def test_a_partial_message_stays_in_the_buffer_until_its_last_byte():
    whole = frame(Cancel(handle=3)) + frame([1, 2])
    buffer = bytearray(whole[:-1])
    assert unframe(buffer) == [Cancel(handle=3)]
    assert bytes(buffer) == frame([1, 2])[:-1]
    buffer += whole[-1:]
    assert unframe(buffer) == [[1, 2]] and not buffer
    assert unframe(bytearray(b"\x00")) == [], "not even a whole header yet"


def test_a_broken_length_is_peer_gone():
    buffer = bytearray(HEADER.pack(MAX_MESSAGE_BYTES + 1) + b"x")
    with pytest.raises(PeerGone, match=f"a message of {MAX_MESSAGE_BYTES + 1} bytes"):
        unframe(buffer)


def test_the_engine_messages_survive_the_wire():
    ended = Ended(status="finished", finish_reason="stop", error=None, prompt_len=4, output_len=2,
                  first_token_rules="think_end")
    submit = Submit(handle=2, prompt_tokens=[1, 2], sampling={"max_tokens": 2},
                    features=RequestFeatures(source="api", stop_strings=("x",)), grammar={"kind": "regex", "value": "a"})
    tokens = Tokens(token_ids=[7, 8], logprobs=[(-0.5, [(7, -0.5)])], prompt_logprobs=None)
    batch = Batch(tokens=[(2, [7], [])], ended=[(2, "finished", "stop", None, 4, 2, None)], metrics={1: ["m"]})
    buffer = bytearray(frame([submit, tokens, ended, Cancel(handle=2), batch]))
    assert unframe(buffer) == [[submit, tokens, ended, Cancel(handle=2), batch]]
