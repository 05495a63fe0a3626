"""What a user can type or leave behind never reaches a traceback: search boxes, a stale run label."""
from __future__ import annotations

from pathlib import Path

import pytest

from dashboard.paths import ENV_RUN_DIR
from dashboard.queries.ids import MAX_ECHO, MAX_REQUEST_ID, BadSearch, IdSelection, parse_ids, parse_request_id
from dashboard.queries.requests import parse_search

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
BAD_SEARCHES = ["99999999999999999999999", "1-99999999999999999999999", "²", "1-²", "3, ²", str(2**63),
                "9" * 5000, "1-" + "9" * 5000, "٣٢", "３２", "1_000", "chatcmpl-0a1b"]


@pytest.mark.parametrize("text", BAD_SEARCHES)
def test_parse_search_rejects_what_sqlite_cannot_take(text):
    with pytest.raises(BadSearch):
        parse_search(text)


def test_parse_search_keeps_the_good_forms():
    assert parse_search(" 12 ") == IdSelection((12,)) and parse_search("3, 7") == IdSelection((3, 7))
    assert parse_search("10-20") == parse_search("10 - 20") == IdSelection((), ((10, 20),))
    assert parse_search("3 10-20, 7") == IdSelection((3, 7), ((10, 20),))
    assert parse_search(str(MAX_REQUEST_ID)) == IdSelection((MAX_REQUEST_ID,))
    assert parse_search("0" * 30 + "12") == IdSelection((12,))      # leading zeros do not count as size
    assert parse_request_id("0") == 0


def test_an_api_id_is_read_as_its_engine_request_id():
    """The OpenAI-compatible API's id ends in the engine's request id (engine/api/choices.py)."""
    assert parse_request_id("chatcmpl-099a4c1e2b-17") == 17 and parse_request_id("cmpl-5f3e-0") == 0
    assert parse_ids("chatcmpl-099a4c1e2b-17, 3") == IdSelection((17, 3))
    with pytest.raises(BadSearch, match="carries no engine request id"):
        parse_request_id("chatcmpl-099a4c1e2b")


@pytest.mark.parametrize("digits", [19, 20, 4300, 4301, 5000, 100_000])
def test_any_length_of_digits_is_a_short_message(digits):
    """int() refuses more than 4,300 digits with a ValueError that used to reach the page; the
    message quotes at most MAX_ECHO characters of what was typed."""
    with pytest.raises(BadSearch, match="too large") as caught:
        parse_ids("9" * digits)
    assert len(str(caught.value)) < MAX_ECHO + 200
    where, params = parse_ids("1-" + "9" * 18).where()
    assert where == "(request_id BETWEEN ? AND ?)" and params == [1, int("9" * 18)]


@pytest.mark.parametrize("text", BAD_SEARCHES)
def test_requests_search_box_says_why_inline(app, text):
    at = app("requests")
    at.text_input(key="requests_search").input(text).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.error and len(at.error[0].value.splitlines()) == 1


@pytest.mark.parametrize("text", [str(2**63), "99999999999999999999999", "²", "-3"])
def test_chunks_request_box_says_why_inline(app, text):
    at = app("chunks")
    at.text_input(key="chunks_request").input(text).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.error and "request id" in at.error[0].value


@pytest.mark.parametrize("stale", ["latest (run 2 · finished)", "run 9 · tiny", 99])
def test_a_stale_run_choice_falls_back_to_the_latest_run(run_fixture, monkeypatch, stale):
    """The browser sends back the label it showed; after Stop engine that label (with the old
    status) named no option any more, and ``int()`` of it crashed every page once a second."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv(ENV_RUN_DIR, str(run_fixture.run_dir))
    at = AppTest.from_file(APP, default_timeout=30)
    at.session_state["chosen_run"] = stale
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "run 2: crashed" in [c.value for c in at.sidebar.caption]
    assert at.sidebar.selectbox[0].value == "latest"


@pytest.mark.parametrize("typed, words", [("99999999", "outside"), ("0", "outside"), ("-5", "outside"),
                                           ("12.7", "not an integer"), ("²", "not an integer")])
def test_an_out_of_range_lever_value_gets_a_message_and_is_not_written(app, run_fixture, typed, words):
    levers_file = run_fixture.run_dir / "levers.json"
    levers_file.unlink(missing_ok=True)
    at = app("levers")
    next(t for t in at.text_input if t.label == "max_prefill_tokens").input(typed).run()
    assert not at.exception
    assert any("max_prefill_tokens: not written" in e.value and words in e.value for e in at.error), \
        [e.value for e in at.error]
    assert not levers_file.exists()


def test_levers_table_shows_ticks_as_integers_and_no_none(app):
    at = app("levers")
    table = at.dataframe[0].value
    assert str(table["applied at tick"].dtype) == "Int64"
    assert not table.astype(str).isin(["None", "nan"]).any().any()


def test_runs_page_shows_the_levers_in_effect_at_the_first_tick(app, run_fixture, tmp_path):
    """A levers file applied at tick 0 is part of the run's start: the compare shows it, not the defaults."""
    import sqlite3

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "telemetry.db"
    db.write_bytes(run_fixture.db.read_bytes())
    conn = sqlite3.connect(db)
    start = {r[0]: r[1] for r in conn.execute("SELECT run_id, levers FROM runs")}
    conn.execute("INSERT INTO lever_changes (run_id, tick, t_ns, name, old, new, source, status, file_version) "
                 "VALUES (2, 0, 0, 'slice_budget', '0', '48', 'file', 'applied', 1)")
    conn.commit()
    conn.close()
    at = app("runs", run_dir=run_dir, run_id=None)
    assert not at.exception
    table = next(d.value for d in at.dataframe if "differs" in d.value.columns)
    run2, run1 = [c for c in table.columns if c.startswith("run ")][:2]
    assert table.loc["slice_budget", run2] == "48"
    assert table.loc["slice_budget", "differs"] == (start[1] is None or '"slice_budget": 48' not in start[1])
    assert "changed later in run 1" in table.columns
    assert table.loc["bisect_no_mix", "changed later in run 1"] == "tick 80: True; tick 160: False"
    assert "2 runs" in [m.value for m in at.markdown][0]
    listing = at.dataframe[0].value
    assert "started_at" not in listing.columns and str(listing["started"].dtype).startswith("datetime64")


def test_a_huge_bundle_window_is_a_message_not_a_traceback(real_app):
    at = real_app("runs")
    at.number_input(key="bundle_since_s").set_value(1e300).run()
    at.button(key="bundle_build").click().run(timeout=60)
    assert not at.exception, [e.value for e in at.exception]
    assert any(e.value.startswith("Bundle not built: time window since 1e+300 s") for e in at.error)
