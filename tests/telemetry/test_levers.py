import json
import os

import pytest

from telemetry import levers as lv
from telemetry.levers import LeverValues, LeversError


def test_registry_and_values_agree():
    assert [lever.name for lever in lv.LEVERS] == list(LeverValues().as_dict())
    assert lv.defaults() == LeverValues()
    for lever in lv.LEVERS:
        assert lever.env_var == "CHUNKSCOPE_" + lever.name.upper()
        assert len(lever.help) > 60 and "Watch" in lever.help, lever.name
        lever.check(lever.default)


def test_values_are_immutable_and_checked():
    values = LeverValues()
    with pytest.raises(Exception):
        values.slice_budget = 3
    changed = values.replace(speculation="mtp", kv_blocks_cap=12)
    assert changed.speculation == "mtp" and values.speculation == "off"
    assert changed.changes_from(values) == {"speculation": ("off", "mtp"), "kv_blocks_cap": (0, 12)}
    with pytest.raises(LeversError, match="unknown lever 'nope'"):
        values.replace(nope=1)
    with pytest.raises(LeversError, match="expected int, got bool"):
        values.replace(max_prefill_tokens=True)
    with pytest.raises(LeversError, match="outside"):
        values.replace(slice_budget=0)


def test_from_env():
    env = {"CHUNKSCOPE_BISECT_NO_MIX": "1", "CHUNKSCOPE_MAX_PREFILL_TOKENS": " 128 ",
           "CHUNKSCOPE_PREEMPT_POLICY": "newest", "UNRELATED": "x"}
    values = lv.from_env(env)
    assert values == LeverValues(bisect_no_mix=True, max_prefill_tokens=128, preempt_policy="newest")
    assert lv.from_env({}) == LeverValues()


@pytest.mark.parametrize("name, text, message", [
    ("CHUNKSCOPE_BISECT_NO_MIX", "maybe", "not a boolean"),
    ("CHUNKSCOPE_MAX_PREFILL_TOKENS", "12.5", "not an integer"),
    ("CHUNKSCOPE_KV_BLOCKS_CAP", "-1", "outside"),
    ("CHUNKSCOPE_SPECULATION", "eagle", "not one of"),
])
def test_bad_env_names_the_variable(name, text, message):
    with pytest.raises(LeversError, match=message) as info:
        lv.from_env({name: text})
    assert name in str(info.value)


def _doc(levers=None, version=1, **extra):
    return json.dumps({"version": version, "levers": levers if levers is not None else {}, **extra}).encode()


def test_validate_good_file():
    assert lv.validate_file_bytes(_doc({"speculation": "ngram", "slice_budget": 32}, version=3)) == \
        (3, {"speculation": "ngram", "slice_budget": 32})


BAD_FILES = {
    "too_big": (b'{"version": 1, "levers": {}}' + b" " * (64 * 1024), "over the 65536-byte limit"),
    "empty": (b"", "empty"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "NUL"),
    "not_utf8": (b'{"version": 1, "levers": {"speculation": "\xff"}}', "not UTF-8"),
    "truncated": (_doc({"speculation": "mtp"})[:-7], "invalid JSON"),
    "not_object": (b"[1, 2]", "must be a JSON object"),
    "missing_version": (b'{"levers": {}}', "missing 'version'"),
    "string_version": (_doc(version="3"), "'version' must be a non-negative integer"),
    "bool_version": (_doc(version=True), "'version' must be a non-negative integer"),
    "negative_version": (_doc(version=-1), "non-negative"),
    "missing_levers": (b'{"version": 1}', "'levers'"),
    "levers_not_object": (b'{"version": 1, "levers": [1]}', "'levers'"),
    "unknown_top_key": (_doc(extra=1), "unknown top-level key 'extra'"),
    "unknown_lever": (_doc({"turbo": True}), "unknown lever 'turbo'"),
    "bool_for_int": (_doc({"max_prefill_tokens": True}), "expected int, got bool"),
    "int_for_bool": (_doc({"bisect_no_mix": 1}), "expected bool, got int"),
    "float_for_int": (_doc({"slice_budget": 12.0}), "expected int, got float"),
    "string_for_int": (_doc({"slice_budget": "12"}), "expected int, got str"),
    "out_of_range": (_doc({"slice_budget": 0}), "outside"),
    "not_in_choices": (_doc({"preempt_policy": "random"}), "not one of"),
    "nan": (b'{"version": 1, "levers": {"slice_budget": NaN}}', "NaN"),
    "duplicate_key": (b'{"version": 1, "version": 2, "levers": {}}', "duplicate key"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_file_rejected_previous_kept(tmp_path, case):
    raw, message = BAD_FILES[case]
    with pytest.raises(LeversError, match=message) as info:
        lv.validate_file_bytes(raw)
    assert "\n" not in str(info.value)
    path = tmp_path / "levers.json"
    path.write_bytes(raw)
    previous = LeverValues(speculation="mtp", slice_budget=16)
    result = lv.read_levers_file(path, previous)
    assert result.values is previous
    assert result.version is None and result.changes == {}
    assert result.error.startswith(str(path)) and message.split("'")[0] in result.error


def test_huge_file_is_rejected_without_reading_it_all(tmp_path):
    path = tmp_path / "levers.json"
    path.write_bytes(b" " * (10 << 20))
    result = lv.read_levers_file(path, LeverValues())
    assert "10485760 bytes" in result.error


def test_write_then_read_round_trip(tmp_path):
    path = tmp_path / "levers.json"
    previous = LeverValues()
    wanted = previous.replace(always_mixed=True, slice_budget=32, preempt_policy="fewest_output")
    lv.write_levers_file(path, 7, wanted)
    assert os.listdir(tmp_path) == ["levers.json"]  # no tmp file left behind
    result = lv.read_levers_file(path, previous)
    assert result.error is None and result.version == 7 and result.values == wanted
    assert result.changes == {"always_mixed": (False, True), "slice_budget": (64, 32),
                              "preempt_policy": ("most_blocks", "fewest_output")}
    assert lv.read_levers_version(path) == 7


def test_partial_file_overrides_only_named_levers(tmp_path):
    path = tmp_path / "levers.json"
    path.write_bytes(_doc({"kv_blocks_cap": 5}, version=2))
    previous = LeverValues(speculation="self")
    result = lv.read_levers_file(path, previous)
    assert result.values == LeverValues(speculation="self", kv_blocks_cap=5)


def test_missing_file_is_no_override(tmp_path):
    result = lv.read_levers_file(tmp_path / "absent.json", LeverValues(kv_blocks_cap=3))
    assert result == lv.LeversReadResult(LeverValues(kv_blocks_cap=3), None, {}, None)


def test_write_refuses_invalid_values(tmp_path):
    with pytest.raises(LeversError, match="unknown lever"):
        lv.write_levers_file(tmp_path / "l.json", 1, {"turbo": True})
    assert os.listdir(tmp_path) == []


from hypothesis import given, settings, strategies as st

_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                            lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=300) | _json_values.map(lambda v: json.dumps(v).encode())
       | st.dictionaries(st.sampled_from([lever.name for lever in lv.LEVERS] + ["x"]), _json_values)
       .map(lambda d: _doc(d)))
def test_any_bytes_give_a_result_or_one_line_levers_error(raw):
    try:
        version, values = lv.validate_file_bytes(raw)
    except LeversError as exc:
        assert "\n" not in str(exc)
        return
    LeverValues().replace(**values)  # whatever validates must also apply
    assert isinstance(version, int)


@pytest.mark.parametrize("text", ["٣٢", "３２", "1_000", "1,000", "²"])
def test_an_int_lever_takes_ascii_digits_only(text):
    """int() reads Arabic-Indic and fullwidth digits and underscores; a lever value must not."""
    with pytest.raises(LeversError, match="ASCII digits 0-9 only"):
        lv.LEVERS_BY_NAME["slice_budget"].parse_text(text)


@pytest.mark.parametrize("digits", [20, 4301, 5000])
def test_an_int_lever_of_any_length_is_out_of_range_not_a_traceback(digits):
    with pytest.raises(LeversError, match="outside"):
        lv.LEVERS_BY_NAME["slice_budget"].parse_text("9" * digits)
    assert lv.LEVERS_BY_NAME["slice_budget"].parse_text(" +32 ") == 32
