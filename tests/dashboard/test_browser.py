"""Real browser: engine + dashboard served, Debian chromium driven by Playwright.

Starts the tiny engine through the dashboard's own engine control, serves the
dashboard with ``streamlit run``, sees the Live page's tick counter move
within 3 s, flips ``bisect_no_mix`` on the Levers page and confirms from
SQLite that the engine applied it. Screenshots go to the test's tmp dir and
to ``test-output/dashboard/``. A second test zooms the Live timeline with a
mouse drag and checks the zoom outlives refreshes and the graph never blanks.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _skip_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (Debian package chromium; .ci/run installs it)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright Python package is not installed"
    if importlib.util.find_spec("engine.serve") is None:
        return "the engine (engine/serve/process.py) is not importable"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


try:
    from playwright.sync_api import Error as _PlaywrightError   # TimeoutError is a subclass
except ImportError:                                              # the tests skip without playwright
    _PlaywrightError = RuntimeError


def _wait_for(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` until it is truthy. A playwright call inside it that times
    out (a rerun replaced the element, a loaded CI machine is slow) is one failed
    poll, not the test's end: only ``timeout_s`` decides that."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except _PlaywrightError as error:
            value, last_error = None, error
        if value:
            return value
        time.sleep(0.2)
    detail = f" (last browser error: {str(last_error).splitlines()[0]})" if last_error else ""
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")


def _count(db: Path, sql: str, params=()) -> int:
    if not db.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return int(conn.execute(sql, params).fetchone()[0] or 0)
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def served_dashboard(run_dir: Path, log: Path):
    """``streamlit run`` of the dashboard on ``run_dir`` at a free loopback port; yields its URL once healthy."""
    port = _free_port()
    dash = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"), "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--", "--run-dir", str(run_dir)],
        cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _healthy(url), 60, "the dashboard to serve")
        yield url
    finally:
        dash.terminate()
        try:
            dash.wait(10)
        except subprocess.TimeoutExpired:
            dash.kill()


@contextlib.contextmanager
def chromium_browser():
    """Debian chromium under Playwright, closed on the way out."""
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    browser = None
    try:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
    finally:
        if browser is not None:
            browser.close()
        pw.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from dashboard import engine_control
    from dashboard.paths import RunPaths

    tmp_path = tmp_path_factory.mktemp("served")
    paths = RunPaths(tmp_path / "run")
    engine_control.start_engine(paths, "tiny", "synthetic", 4.0)
    try:
        with served_dashboard(paths.run_dir, tmp_path / "dashboard.log") as url:
            _wait_for(lambda: _count(paths.db, "SELECT COUNT(*) FROM ticks"), 90, "the engine's first ticks")
            yield url, paths
    finally:
        engine_control.stop_engine(paths, timeout_s=15)


@pytest.fixture(scope="module")
def live_page(served):
    """One browser page on the Live page, shared by the tests (loading it is the slow part)."""
    url, _ = served
    with chromium_browser() as browser:
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(url)
        page.locator('[data-testid="stMetricValue"]').first.wait_for(timeout=60_000)
        yield page

def _tick_value(page) -> int:
    text = page.locator('[data-testid="stMetric"]:has-text("tick") [data-testid="stMetricValue"]').first.inner_text()
    return int(text.strip())


NUM_SAMPLES = 50   # 100 ms apart: the zoom checks run while they are taken
# Runs inside the timeline's frame: a sampler that notes every 100 ms whether the graph is drawn.
_SAMPLER_JS = """() => { window.__drawn = []; window.__sampler = setInterval(() => {
    const graph = document.getElementById('timeline');
    const isDrawn = !!(graph && graph._fullData && graph._fullData.length &&
        graph.querySelector('.cartesianlayer .trace .point, .cartesianlayer .trace path.js-line, .gl-canvas'));
    window.__drawn.push(isDrawn); }, 100); }"""
_GRAPH_STATE_JS = """() => { const graph = document.getElementById('timeline');
    const box = graph.querySelector('.nsewdrag').getBoundingClientRect();
    return {range: graph._fullLayout.xaxis.range.slice(), revision: graph.dataset.revision,
            box: [box.x, box.y, box.width, box.height]}; }"""


def _timeline_frame(page):
    frame_element = page.locator('iframe[src*="live_timeline"]')
    frame_element.wait_for(timeout=60_000)
    return frame_element.element_handle().content_frame()


def _revisions_seen(frame, first: str, count: int, timeout_s: float) -> list[str]:
    seen = [first]
    deadline = time.monotonic() + timeout_s
    while len(seen) <= count and time.monotonic() < deadline:
        revision = frame.evaluate(_GRAPH_STATE_JS)["revision"]
        if revision != seen[-1]:
            seen.append(revision)
        frame.wait_for_timeout(100)
    return seen


def test_live_timeline_keeps_zoom_and_never_blanks(live_page, tmp_path):
    page = live_page
    frame = _timeline_frame(page)
    frame.locator("#timeline .nsewdrag").wait_for(state="attached", timeout=30_000)
    frame.evaluate(_SAMPLER_JS)

    # zoom the way a user does: drag across the middle fifth of the plot
    state = frame.evaluate(_GRAPH_STATE_JS)
    window_width = state["range"][1] - state["range"][0]
    frame_box = frame.frame_element().bounding_box()
    x, y, width, height = state["box"]
    left, mid_y = frame_box["x"] + x + 0.4 * width, frame_box["y"] + y + 0.45 * height
    page.mouse.move(left, mid_y)
    page.mouse.down()
    page.mouse.move(left + 0.1 * width, mid_y, steps=4)
    page.mouse.move(left + 0.2 * width, mid_y, steps=4)
    page.mouse.up()
    zoomed = frame.evaluate(_GRAPH_STATE_JS)
    zoom = zoomed["range"]
    assert zoom[1] - zoom[0] < 0.5 * window_width, f"the drag did not zoom: {state['range']} -> {zoom}"

    revisions = _revisions_seen(frame, zoomed["revision"], 2, 8.0)
    assert len(revisions) >= 3, f"the timeline got fewer than 2 new figures in 8 s: {revisions}"
    kept = frame.evaluate(_GRAPH_STATE_JS)["range"]
    assert kept == pytest.approx(zoom, abs=1e-6), f"zoom {zoom} was reset to {kept} by a refresh"

    # a double-click gives up the zoom: the next figure follows the live window again
    page.mouse.dblclick(left + 0.1 * width, mid_y)
    _revisions_seen(frame, frame.evaluate(_GRAPH_STATE_JS)["revision"], 1, 5.0)
    following = frame.evaluate(_GRAPH_STATE_JS)["range"]
    is_following = following[1] > zoom[1] and following[1] - following[0] > 2 * (zoom[1] - zoom[0])
    assert is_following, f"after a double-click the timeline stayed at {following}, zoom was {zoom}"

    _wait_for(lambda: frame.evaluate("(n) => !window.__drawn || window.__drawn.length >= n", NUM_SAMPLES), 15,
              f"{NUM_SAMPLES} samples of the timeline")
    drawn = frame.evaluate("() => { clearInterval(window.__sampler); return window.__drawn || null; }")
    page.screenshot(path=str(tmp_path / "live_zoomed.png"))
    assert drawn is not None, "the timeline's frame was reloaded (its sampler is gone): a refresh remounted it"
    assert sum(drawn) >= 0.9 * len(drawn), f"timeline drawn in only {sum(drawn)} of {len(drawn)} 100 ms samples"


def test_live_updates_and_lever_flip_reaches_engine(served, live_page, tmp_path):
    _, paths = served
    out_dir = ROOT / "test-output" / "dashboard"
    out_dir.mkdir(parents=True, exist_ok=True)
    page = live_page
    page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
    first = _tick_value(page)
    start = time.monotonic()
    _wait_for(lambda: _tick_value(page) > first, 3.0, "the Live tick counter to move within 3 s")
    assert time.monotonic() - start <= 3.0
    page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
    shutil.copy(tmp_path / "live.png", out_dir / "live.png")

    page.locator('[data-testid="stSidebarNav"] a:has-text("Levers")').click()
    toggle = page.locator('[data-testid="stCheckbox"]:has-text("bisect_no_mix")').first
    toggle.wait_for(timeout=30_000)
    toggle.locator("label").first.click()
    _wait_for(lambda: paths.levers.exists() and json.loads(paths.levers.read_text())["levers"].get("bisect_no_mix"),
              10, "levers.json to ask for bisect_no_mix = true")
    _wait_for(lambda: _count(paths.db, "SELECT COUNT(*) FROM lever_changes WHERE name = 'bisect_no_mix' "
                                       "AND status = 'applied' AND new IN ('true', '1')"),
              20, "the engine to apply bisect_no_mix")
    page.wait_for_timeout(1500)
    page.reload()
    applied = page.locator('[data-testid="stMarkdownContainer"]').filter(
        has_text=re.compile(r"in sync · pending\s*True\s*· applied\s*True\s*since tick \d+"))
    applied.first.wait_for(timeout=20_000)
    page.screenshot(path=str(tmp_path / "levers.png"), full_page=True)
    shutil.copy(tmp_path / "levers.png", out_dir / "levers.png")
    assert os.path.getsize(tmp_path / "live.png") > 10_000
