"""Links from a chunk decision to its request: the Requests page opened on one request of one run.

A click on a forward in the Live timeline (its frame posts the clicked point's
request id) and the Chunks table's request links both land on the Requests
page as query parameters, ``?run=3&request=12``. These functions are pure
(plain values in and out) so they are tested without Streamlit or a browser.
"""
from __future__ import annotations

from typing import Any, Mapping

from dashboard.queries.ids import BadSearch, parse_request_id

REQUESTS_PAGE = "app_pages/requests.py"
REQUESTS_URL_PATH = "requests"        # st.Page's URL path for app_pages/requests.py
RUN_PARAM, REQUEST_PARAM = "run", "request"


def link_params(run_id: int, request_id: int) -> dict[str, str]:
    """Query parameters that open the Requests page on ``request_id`` of ``run_id``."""
    return {RUN_PARAM: str(int(run_id)), REQUEST_PARAM: str(int(request_id))}


def link_url(run_id: int, request_id: int) -> str:
    """A relative URL to the same (for a table's link column)."""
    params = link_params(run_id, request_id)
    return f"{REQUESTS_URL_PATH}?{RUN_PARAM}={params[RUN_PARAM]}&{REQUEST_PARAM}={params[REQUEST_PARAM]}"


def clicked_request(value: Any, last_handled: Any) -> tuple[int, Any] | None:
    """The request a new click on the timeline asks for, as (request id, click stamp), or None.

    ``value`` is the frame's component value, ``{"request_id": 12, "clicked_at": 1712...}``; it
    stays set after the click, so a click is acted on once: when its stamp differs from
    ``last_handled``. Anything malformed (no request behind the point, a float that is not a whole
    id) is ignored: a click on a decode forward has no chunk and so no request.
    """
    if not isinstance(value, Mapping):
        return None
    stamp, request = value.get("clicked_at"), value.get("request_id")
    if stamp is None or stamp == last_handled or isinstance(request, bool):
        return None
    if isinstance(request, float) and request.is_integer():
        request = int(request)
    if not isinstance(request, int) or request < 0:
        return None
    return request, stamp


def linked_value(query_params: Mapping[str, Any], name: str) -> int | None:
    """A run or request id from the URL, or None when absent or not a valid id."""
    text = query_params.get(name)
    if not isinstance(text, str):
        return None
    try:
        return parse_request_id(text.strip(), name)
    except BadSearch:
        return None
