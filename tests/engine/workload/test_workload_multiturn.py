"""Multi-turn conversations: each turn's prompt extends the previous one."""
import pytest

from engine.workload.multiturn import MultiTurnWorkload
from engine.workload.request import WorkloadError


def make(**kw):
    return MultiTurnWorkload(vocab_size=kw.pop("vocab_size", 300), **kw)


def test_each_turn_starts_with_the_previous_turn_and_its_answer():
    specs = make(num_conversations=3, num_turns=4, output_len=7).requests()
    assert len(specs) == 12
    by = {(s.conversation_id, s.turn): s for s in specs}
    for c in range(3):
        for t in range(1, 4):
            prev, cur = by[(c, t - 1)], by[(c, t)]
            assert cur.prompt_tokens[:prev.prompt_len] == prev.prompt_tokens
            # answer stand-in (7 tokens) + at least user_len_min new tokens
            assert cur.prompt_len >= prev.prompt_len + 7 + 4
            assert cur.arrival_s >= prev.arrival_s


def test_system_prompt_shared_across_conversations():
    specs = make(num_conversations=4, system_prompt_len=16).requests()
    firsts = [s for s in specs if s.turn == 0]
    assert len({tuple(s.prompt_tokens[:16]) for s in firsts}) == 1
    assert len({tuple(s.prompt_tokens[16:]) for s in firsts}) == 4


def test_sorted_numbered_seeded():
    a = make(seed=5).requests()
    assert a == make(seed=5).requests() and a != make(seed=6).requests()
    assert [s.request_id for s in a] == list(range(len(a)))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))


def test_think_time_spaces_turns():
    specs = make(num_conversations=1, num_turns=3, think_time_s=0, answer_time_s=0.5, output_len=4).requests()
    assert [s.arrival_s for s in specs] == [0.0, 2.0, 4.0]


def test_describe_reports_reusable_ratio():
    d = make(num_turns=1).describe()
    assert d["reusable_prompt_ratio"] == 0.0
    d = make(num_turns=6, user_len_median=8, user_len_sigma=0).describe()
    assert d["reusable_prompt_ratio"] > 0.5 and d["kind"] == "multiturn"


@pytest.mark.parametrize("kw, field", [
    (dict(num_turns=0), "num_turns"), (dict(think_time_s=-1), "think_time_s"),
    (dict(user_len_min=9, user_len_max=3), "user_len_min"), (dict(turns=3), "turns"),
])
def test_bad_options_name_the_field(kw, field):
    with pytest.raises(WorkloadError, match=field):
        make(**kw)
