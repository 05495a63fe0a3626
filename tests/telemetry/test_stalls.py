"""Blocked spells from stall events: the only record of time the engine could not step."""
from __future__ import annotations

from telemetry.events import EVENT_STALL_CLEARED, EVENT_STALLED
from telemetry.stalls import Spell, blocked_spells


def test_spells_pair_stalled_with_cleared_and_a_new_blocker_ends_the_last():
    rows = [(10, EVENT_STALLED, '{"blocker": "cap is 8"}'), (30, EVENT_STALL_CLEARED, "{}"),
            (50, EVENT_STALLED, {"blocker": "cap is 1"}), (60, EVENT_STALLED, '{"blocker": "cap is 2"}'),
            (90, EVENT_STALL_CLEARED, None), (95, EVENT_STALL_CLEARED, None)]
    assert blocked_spells(rows) == [Spell(10, 30, "cap is 8", False), Spell(50, 60, "cap is 1", False),
                                    Spell(60, 90, "cap is 2", False)]


def test_an_open_spell_ends_at_the_given_end_never_before_it_began():
    rows = [(100, EVENT_STALLED, '{"blocker": "b"}')]
    assert blocked_spells(rows, open_end_ns=4_000) == [Spell(100, 4_000, "b", True)]
    assert blocked_spells(rows, open_end_ns=50) == [Spell(100, 100, "b", True)]
    assert blocked_spells(rows)[0].seconds == 0.0 and blocked_spells([]) == []
