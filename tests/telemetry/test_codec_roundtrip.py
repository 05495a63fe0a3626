"""Every event class survives its row codec for any values its annotations allow (hypothesis): encode,
insert into the real schema, read back, decode, equal. Plus the summary.md cell rules a reader relies on."""
from __future__ import annotations

import sqlite3
import typing

import sqlite_utils
from hypothesis import HealthCheck, given, settings, strategies as st

from telemetry import events as ev
from telemetry import schema
from telemetry.summary_md import _cell, _ids, _table

INTS = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**53), 2**53) | FLOATS | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3),
                    max_leaves=8)


def strategy_for(hint) -> st.SearchStrategy:
    """Values of one field annotation as the engine fills it."""
    args = typing.get_args(hint)
    if type(None) in args:
        (base,) = [a for a in args if a is not type(None)]
        return st.none() | strategy_for(base)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return INTS
    if hint is float:
        return FLOATS
    if hint is str:
        return st.text(max_size=20)
    if typing.get_origin(hint) is list:
        return st.lists(INTS, max_size=5)
    if typing.get_origin(hint) is dict:
        return st.dictionaries(st.text(max_size=6), JSON, max_size=4)
    return JSON   # typing.Any: a lever's old / new value


def events_of(cls) -> st.SearchStrategy:
    return st.builds(cls, **{name: strategy_for(hint) for name, hint in schema.field_hints(cls).items()})


@st.composite
def any_event(draw):
    return draw(events_of(draw(st.sampled_from(ev.EVENT_TYPES))))


def store() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    schema.ensure_schema(sqlite_utils.Database(conn))
    conn.row_factory = sqlite3.Row
    return conn


CONN = store()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event=any_event())
def test_any_event_survives_its_row(event):
    codec = schema.codec_for(type(event))
    CONN.execute(f"DELETE FROM [{codec.table}]")
    CONN.execute(codec.insert_sql, codec.encode(7, event))
    row = dict(CONN.execute(f"SELECT * FROM [{codec.table}]").fetchone())
    assert row["run_id"] == 7
    back = codec.decode(row)
    assert back == event
    for name, hint in schema.field_hints(type(event)).items():
        value = getattr(event, name)
        if isinstance(value, bool):
            assert type(getattr(back, name)) is bool, f"{name}: a bool stays a bool"


def test_columns_follow_the_annotations():
    columns = schema.columns_for(ev.RequestRecord)
    assert columns["request_id"] is int and columns["prompt_tokens"] is str and columns["sampling"] is str
    assert schema.columns_for(ev.StreamEvent)["gpu_elapsed_ms"] is float
    assert schema.is_json_field(typing.Any) and not schema.is_json_field(int | None)
    assert schema.json_value('{"a": [1]}') == {"a": [1]} and schema.json_value("plain text") == "plain text"
    assert schema.json_value(3) == 3


def test_summary_cells_keep_the_markdown_table_intact():
    assert _cell("a|b\nc") == "a\\|b c", "a pipe or newline would break the row"
    assert _cell(0.123456) == "0.123" and _cell(None) == "null" and _cell(True) == "true"
    assert _cell({"k": [1]}) == '{"k": [1]}' and _cell(12) == "12"
    assert _table(["a", "b"], [[1, "x|y"]]) == ["| a | b |", "|---|---|", "| 1 | x\\|y |"]


def test_request_ids_in_the_error_table_are_capped():
    assert _ids(None) == "" and _ids("3") == "3"
    assert _ids(",".join(str(i) for i in range(15))) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 (+3)"
    assert _ids("1,2,3", limit=3) == "1, 2, 3"
