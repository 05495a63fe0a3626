"""Real browser on a finished real run: every page at a default and a narrow width with nothing cut
by an ellipsis, and a click on a forward in the Live timeline opening its request on the Requests page.

One ``streamlit run`` on the real engine run of ``real_run_dir`` (static: no engine is serving, so
the pages hold still), driven by Debian chromium through Playwright.
"""
from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import pytest

from test_browser import _skip_reason, _wait_for, chromium_browser, served_dashboard

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PAGES = ("Live", "Chunks", "Requests", "Levers", "Runs")
WIDTHS = (1280, 1000)        # Playwright's default window, and a narrow laptop one
# Text Streamlit cuts with "…" when it does not fit its box: metric labels / values, captions,
# widget labels, select values, tabs. Returns [testid, text, needed px, given px] per cut.
_CUT_TEXT_JS = """() => {
  const cut = [];
  const boxes = document.querySelectorAll('[data-testid="stMarkdownContainer"], [data-testid="stCaptionContainer"],'
      + ' [data-testid="stWidgetLabel"] *, [data-baseweb="select"] *, [data-baseweb="tab"] *');
  for (const el of boxes) {
    if (getComputedStyle(el).textOverflow === 'ellipsis' && el.scrollWidth > el.clientWidth + 1) {
      const owner = el.closest('[data-testid^="stMetric"]') || el.closest('[data-testid]');
      cut.push([owner.getAttribute('data-testid'), el.innerText.slice(0, 60), el.scrollWidth, el.clientWidth]);
    }
  }
  return cut;
}"""
# Runs inside the timeline's frame: the screen point (frame coordinates) of the widest forward that
# carries a chunk, and its request id.
_FORWARD_POINT_JS = """() => {
  const graph = document.getElementById('timeline');
  const xa = graph._fullLayout.xaxis, ya = graph._fullLayout.yaxis;
  let best = null;
  for (const trace of graph._fullData) {
    if (trace.type !== 'bar' || !/forward$/.test(trace.name) || !trace.customdata) continue;
    for (let i = 0; i < trace.x.length; i++) {
      const request = Number(trace.customdata[i][3]);
      if (!Number.isFinite(request)) continue;
      const start = Number(trace.base[i]), width = Number(trace.x[i]);
      const mid = start + width / 2;
      if (mid < xa.range[0] || mid > xa.range[1]) continue;
      if (best === null || width > best.width) best = {width, mid, y: Number(trace.y[i]), request};
    }
  }
  if (best === null) return null;
  return {x: xa._offset + xa.l2p(best.mid), y: ya._offset + ya.l2p(best.y), request: best.request};
}"""


@pytest.fixture(scope="module")
def browser_on_real_run(real_run_dir, tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    log = tmp_path_factory.mktemp("pages") / "dashboard.log"
    with served_dashboard(real_run_dir.run_dir, log) as url, chromium_browser() as browser:
        yield browser, url

def _open(page, url: str, name: str) -> None:
    page.goto(url if name == "Live" else f"{url}/{name.lower()}")
    page.locator("h1").filter(has_text=name).first.wait_for(timeout=60_000)
    # the page body (metrics, tables, charts) is drawn after the title
    page.locator('[data-testid="stMetric"], [data-testid="stDataFrame"], .js-plotly-plot').first.wait_for(
        timeout=60_000)
    page.wait_for_timeout(1500)


@pytest.mark.parametrize("width", WIDTHS)
def test_no_page_cuts_a_label_or_value(browser_on_real_run, width, tmp_path):
    browser, url = browser_on_real_run
    page = browser.new_page(viewport={"width": width, "height": 900})
    try:
        cut = {}
        for name in PAGES:
            _open(page, url, name)
            assert page.locator('[data-testid="stException"]').count() == 0
            found = page.evaluate(_CUT_TEXT_JS)
            if found:
                cut[name] = found
                page.screenshot(path=str(tmp_path / f"{name}_{width}.png"), full_page=True)
        assert not cut, f"text cut with an ellipsis at {width} px: {cut}"
    finally:
        page.close()


def test_a_click_on_a_forward_opens_its_request(browser_on_real_run, real_run_dir):
    browser, url = browser_on_real_run
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    try:
        _open(page, url, "Live")
        frame_element = page.locator('iframe[src*="live_timeline"]')
        frame_element.wait_for(timeout=60_000)
        frame = frame_element.element_handle().content_frame()
        frame.locator("#timeline .nsewdrag").wait_for(state="attached", timeout=30_000)
        point = frame.evaluate(_FORWARD_POINT_JS)
        assert point is not None, "no forward with a chunk in the Live window of a finished run"
        box = frame_element.bounding_box()
        page.mouse.move(box["x"] + point["x"], box["y"] + point["y"])
        page.wait_for_timeout(300)          # plotly shows the hover, then the click lands on that point
        page.mouse.click(box["x"] + point["x"], box["y"] + point["y"])
        page.wait_for_url(re.compile(r".*/requests\?.*request=\d+"), timeout=20_000)
        params = parse_qs(urlparse(page.url).query)
        assert params["request"] == [str(point["request"])]
        assert params["run"] == [str(real_run_dir.one("SELECT MAX(run_id) FROM runs"))]
        search = page.get_by_role("textbox", name="search request ids", exact=True)
        holds_id = lambda: search.input_value(timeout=2_000) == str(point["request"])
        try:
            _wait_for(holds_id, 30, "the search box to hold the id")
        except AssertionError:
            # Seen once in a loaded CI run: the URL had switched to the Requests page but no widget of
            # it was drawn for 60 s (a rerun racing the Live page's timed fragments). The link itself
            # must still open the request: load the very URL the click produced and check again,
            # with what the page showed in the message if it fails.
            shown = page.locator("body").inner_text(timeout=5_000)[:400]
            page.goto(page.url)
            _wait_for(holds_id, 60, f"the search box to hold the id after reloading {page.url} "
                                    f"(the page showed: {shown!r})")
        page.get_by_text(re.compile(r"^1 request shown")).first.wait_for(timeout=60_000)   # a loaded CI machine
        assert page.locator('[data-testid="stException"]').count() == 0
    finally:
        page.close()
