"""Real browser, a newcomer's first hour (issue 29): find an API request by the id the ``openai``
client got, type 5,000 digits into every id box, and block the engine with ``kv_blocks_cap`` and
find the stall on the Live timeline and in the Runs page's replay report.

One engine (``serve --workload none --api-port P``: only the test's own requests, so the pages hold
still between them), one ``streamlit run`` and one chromium page for the module. Waits poll with a
bound; the one sleep is the stall itself (blocked wall time is what the test looks for).
"""
from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

from test_browser import _count, _skip_reason, _wait_for, chromium_browser, served_dashboard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from serve_process import start_serve, stop  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.slow]

MANY_DIGITS = "9" * 5000
STALL_S = 3.0                 # how long the cap keeps the engine blocked
CAP = 1                       # KV blocks: no prompt of the test's requests fits
BLOCKED_TRACE_JS = """() => { const graph = document.getElementById('timeline');
  if (!graph || !graph._fullData) return null;
  const band = graph._fullData.find((t) => t.name && t.name.startsWith('blocked'));
  const levers = graph._fullData.find((t) => t.name === 'lever change');
  const range = graph._fullLayout.xaxis.range;
  return {text: band ? Array.from(band.text) : [], seconds: band ? Array.from(band.x).map(Number) : [],
          levers: levers ? Array.from(levers.x).map(Number) : [], range: range.map(Number),
          title: graph._fullLayout.xaxis.title.text}; }"""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    import httpx
    import openai

    from test_browser import _free_port

    tmp_path = tmp_path_factory.mktemp("find")
    run_dir, port = tmp_path / "run", _free_port()
    proc = start_serve(run_dir, "--workload", "none", "--api-port", str(port), "--kv-blocks", "64")
    api = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{api}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None      # an engine that died fails below, not after 90 s

    try:
        _wait_for(healthy, 90, "the engine's API")
        assert proc.poll() is None, Path(proc.stderr_path).read_text()[-2000:]
        client = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0, timeout=120)
        with served_dashboard(run_dir, tmp_path / "dashboard.log") as url, chromium_browser() as browser:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            yield page, url, client, run_dir
    finally:
        stop(proc)


def _goto(page, url: str, name: str) -> None:
    page.goto(url if name == "Live" else f"{url}/{name.lower()}")
    page.locator("h1").filter(has_text=name).first.wait_for(timeout=60_000)


def _no_traceback(page) -> None:
    error = page.locator('[data-testid="stException"]')
    assert error.count() == 0, error.first.inner_text()


def _type(page, label: str, text: str) -> None:
    box = page.get_by_label(label, exact=True)
    box.wait_for(timeout=60_000)
    box.fill(text)
    box.press("Enter")


def test_an_api_request_is_found_by_the_id_the_client_got(session):
    page, url, client, run_dir = session
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "where am I?"}],
                                           max_tokens=4)
    request_id = int(reply.id.rsplit("-", 1)[1])
    db = run_dir / "telemetry.db"
    _wait_for(lambda: _count(db, "SELECT COUNT(*) FROM requests WHERE request_id = ? AND source = 'api' "
                                 "AND status = 'finished'", (request_id,)), 30, "the API request's row")
    num_chunks = _count(db, "SELECT COUNT(*) FROM chunks WHERE request_id = ?", (request_id,))
    assert num_chunks >= 1

    _goto(page, url, "Requests")
    _type(page, "search request ids", reply.id)
    page.get_by_text(re.compile(r"^1 requests? shown")).first.wait_for(timeout=30_000)
    page.locator(".js-plotly-plot").get_by_text(f"req {request_id}").first.wait_for(timeout=30_000)
    _no_traceback(page)

    _goto(page, url, "Chunks")
    _type(page, "request ids", reply.id)
    page.get_by_text(re.compile(rf"^{num_chunks} chunk decisions? match")).first.wait_for(timeout=30_000)
    _no_traceback(page)


@pytest.mark.parametrize("name, label", [("Requests", "search request ids"), ("Chunks", "request ids")])
def test_five_thousand_digits_in_an_id_box_is_a_message(session, name, label):
    page, url, _, _ = session
    _goto(page, url, name)
    _type(page, label, MANY_DIGITS)
    alert = page.locator('[data-testid="stAlert"]').filter(has_text="too large")
    alert.first.wait_for(timeout=30_000)
    assert len(alert.first.inner_text()) < 300          # the 5,000 digits are not echoed back
    _no_traceback(page)


def _timeline(page):
    frame_element = page.locator('iframe[src*="live_timeline"]')
    frame_element.wait_for(timeout=60_000)
    return frame_element.element_handle().content_frame()


def _widest_window(page) -> None:
    """Drag the Live page's "timeline window (s)" slider to its last stop (300 s), as a user would."""
    track = page.locator('[data-testid="stSlider"]').first
    thumb = track.get_by_role("slider").first
    thumb.wait_for(timeout=60_000)
    start, end = thumb.bounding_box(), track.bounding_box()
    y = start["y"] + start["height"] / 2
    page.mouse.move(start["x"] + start["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(end["x"] + end["width"] + 50, y, steps=8)
    page.mouse.up()
    page.get_by_text(re.compile(r"^last 300 s of run")).first.wait_for(timeout=30_000)


def test_a_kv_cap_stall_is_on_the_timeline_and_in_the_replay_report(session):
    from telemetry.engine_status import read_engine_status
    from telemetry.levers import defaults, write_levers_file

    page, url, client, run_dir = session
    db = run_dir / "telemetry.db"
    client.completions.create(model="tiny", prompt="before the cap", max_tokens=2)   # the run has ticks to draw
    applied = "SELECT COUNT(*) FROM lever_changes WHERE status = 'applied'"
    num_before = _count(db, applied)
    write_levers_file(run_dir / "levers.json", 10, defaults().replace(kv_blocks_cap=CAP))
    _wait_for(lambda: _count(db, applied) > num_before, 30, "the engine to apply the cap")
    replies: list = []
    worker = threading.Thread(target=lambda: replies.append(client.completions.create(
        model="tiny", prompt="a prompt longer than one KV block of sixteen tokens", max_tokens=3)), daemon=True)
    worker.start()
    _wait_for(lambda: (read_engine_status(run_dir) or {}).get("is_blocked"), 30, "the engine to block")

    _goto(page, url, "Live")        # while blocked: the open stall is drawn after the last forward
    _widest_window(page)            # the whole stall and every change made around it in view
    frame = _timeline(page)
    _wait_for(lambda: any("still blocked" in t and f"cap is {CAP}" in t
                          for t in (frame.evaluate(BLOCKED_TRACE_JS) or {}).get("text", [])),
              30, "the open stall on the Live timeline")
    time.sleep(STALL_S)             # the stall is wall time: let it last
    write_levers_file(run_dir / "levers.json", 11, defaults().replace(kv_blocks_cap=CAP, slice_budget=32))
    _wait_for(lambda: _count(db, applied) >= num_before + 2, 30, "the change made while blocked")
    write_levers_file(run_dir / "levers.json", 12, defaults())
    worker.join(timeout=120)
    assert replies, "the blocked request did not finish once the cap was lifted"
    _wait_for(lambda: _count(db, "SELECT COUNT(*) FROM events WHERE kind = 'stall_cleared'"), 30, "the stall to clear")

    num_changes = _count(db, applied)
    def closed_stall():
        drawn = frame.evaluate(BLOCKED_TRACE_JS) or {}
        return drawn if drawn.get("seconds") and not any("still" in t for t in drawn["text"]) else None
    drawn = _wait_for(closed_stall, 30, "the cleared stall on the Live timeline")
    assert max(drawn["seconds"]) >= STALL_S and drawn["title"] == "s since run start"
    lo, hi = drawn["range"]
    assert len(drawn["levers"]) == num_changes - num_before == 4   # cap on, slice 32, cap off + slice back: all in view
    assert all(lo <= x <= hi for x in drawn["levers"]), drawn
    _no_traceback(page)

    _goto(page, url, "Runs")
    build = page.get_by_role("button", name=re.compile(r"^Build bundle of run"))
    build.wait_for(timeout=60_000)
    build.click()
    page.get_by_text(re.compile(r"^Wrote .*\.zip")).first.wait_for(timeout=120_000)
    replay = page.get_by_role("button", name="Replay (no flip)")
    replay.wait_for(timeout=30_000)
    replay.click()
    report = page.locator('[data-testid="stAlert"]').filter(has_text="lever changes:")
    report.first.wait_for(timeout=240_000)
    text = report.first.inner_text()
    assert f"lever changes: {num_changes} recorded, {num_changes} replayed" in text, text
    blocked = re.search(r"blocked: ([0-9.]+) s recorded in 1 spell", text)
    assert blocked and float(blocked[1]) >= STALL_S, text
    assert f"cap is {CAP}" in text and "TTFT p99:" in text and "replayed at tick" in text, text
    _no_traceback(page)
