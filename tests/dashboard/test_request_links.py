"""Links from a chunk decision to its request: the pure pieces, and the pages following ``?run=&request=``."""
from __future__ import annotations

import pytest

from dashboard.request_links import clicked_request, link_params, link_url, linked_value


def test_link_params_and_url_name_the_run_and_the_request():
    assert link_params(3, 12) == {"run": "3", "request": "12"}
    assert link_url(3, 12) == "requests?run=3&request=12"


def test_a_click_is_acted_on_once():
    value = {"request_id": 12.0, "tick": 40.0, "clicked_at": 1000}
    assert clicked_request(value, None) == (12, 1000)
    assert clicked_request(value, 1000) is None                      # the value stays set after the click
    assert clicked_request({**value, "clicked_at": 1001}, 1000) == (12, 1001)   # a second click


@pytest.mark.parametrize("value", [None, "12", {}, {"request_id": 12}, {"clicked_at": 5},
                                   {"request_id": 1.5, "clicked_at": 5}, {"request_id": -1, "clicked_at": 5},
                                   {"request_id": True, "clicked_at": 5}, {"request_id": "7", "clicked_at": 5}])
def test_a_malformed_click_is_ignored(value):
    assert clicked_request(value, None) is None


@pytest.mark.parametrize("text, expected", [("12", 12), (" 7 ", 7), ("", None), ("x", None), ("-1", None),
                                            (str(2**63), None), ("²", None)])
def test_linked_value_takes_only_valid_ids(text, expected):
    assert linked_value({"request": text}, "request") == expected
    assert linked_value({}, "request") is None


def test_the_requests_page_opens_on_the_linked_request(real_app, real_run_dir):
    """``?request=N`` fills the search box with N and shows only that request."""
    at = real_app("requests")
    wanted = int(real_run_dir.one("SELECT MIN(request_id) FROM requests WHERE status = 'finished'"))
    at.query_params["request"] = str(wanted)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.text_input(key="requests_search").value == str(wanted)
    table = at.dataframe[0].value
    assert list(table["request_id"]) == [wanted]
    # the user can search something else afterwards: the link does not overwrite it again
    at.text_input(key="requests_search").input("").run()
    assert at.text_input(key="requests_search").value == ""
    assert len(at.dataframe[0].value) > 1


def test_a_run_link_picks_that_run(app, run_fixture):
    at = app("requests", run_id=None)
    at.query_params["run"] = "1"
    at.query_params["request"] = "0"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["chosen_run"] == 1
    assert at.text_input(key="requests_search").value == "0"


def test_chunks_request_ids_link_to_the_requests_page(real_app, real_run_dir):
    at = real_app("chunks")
    table = at.dataframe[0].value
    run_id = real_run_dir.one("SELECT MAX(run_id) FROM runs")
    assert table["request_id"].str.fullmatch(rf"requests\?run={run_id}&request=\d+").all()

