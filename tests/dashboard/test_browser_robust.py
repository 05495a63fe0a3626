"""Real browser, as a user would: a stall named on the Live page, the Levers page following the engine
without a reload, and Stop engine from the dashboard leaving every page working (it used to crash the
Live page once a second on a stale run label)."""
from __future__ import annotations

import re
import time

import pytest

from test_browser import _count, _skip_reason, _wait_for, chromium_browser, served_dashboard

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from dashboard import engine_control
    from dashboard.paths import RunPaths

    tmp_path = tmp_path_factory.mktemp("robust")
    paths = RunPaths(tmp_path / "run")
    engine_control.start_engine(paths, "tiny", "synthetic", 8.0)
    try:
        with served_dashboard(paths.run_dir, tmp_path / "dashboard.log") as url, chromium_browser() as browser:
            _wait_for(lambda: _count(paths.db, "SELECT COUNT(*) FROM ticks"), 90, "the engine's first ticks")
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(url)
            page.locator('[data-testid="stMetricValue"]').first.wait_for(timeout=60_000)
            yield page, paths
    finally:
        engine_control.stop_engine(paths, timeout_s=15)


def _nav(page, name: str) -> None:
    # force: live fragments redraw every second, so the sidebar link is rarely "stable" for Playwright
    page.locator(f'[data-testid="stSidebarNav"] a:has-text("{name}")').click(force=True)


def _no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


BLOCKED_TEXT = "Engine blocked at tick"
BANNER_TARGET_S = 2.0      # issue 19: the Live page names the blocker within 2 s
# Stamps, with the browser's wall clock (the same clock as time.time() here), the moment the blocker
# text enters the page: what a user sees, not when Playwright's polling gets round to noticing it.
_STAMP_JS = """() => { window.__blockedSeenAt = null;
  if (window.__stampObserver) return;
  window.__stampObserver = new MutationObserver(() => {
    if (window.__blockedSeenAt === null && document.body.innerText.includes('%s')) {
      window.__blockedSeenAt = Date.now() / 1000; } });
  window.__stampObserver.observe(document.body, {subtree: true, childList: true, characterData: true}); }""" \
    % BLOCKED_TEXT
# How late the tab's own 100 ms timer fires, at most, from now on: the browser's main thread starved
# (a machine loaded far past its cores). Streamlit's fragment timers run on that thread too, so time
# the tab could not run anything is not the page's to answer for; everything else is.
_LAG_JS = """() => { window.__lagMax = 0; window.__lagLast = performance.now();
  if (window.__lagTimer) return;
  window.__lagTimer = setInterval(() => { const now = performance.now();
    window.__lagMax = Math.max(window.__lagMax, now - window.__lagLast - 100); window.__lagLast = now; }, 100); }"""


def test_a_stall_is_named_on_the_live_page_within_2_s(session):
    """Twice: block the engine with a cap no request fits under; the Live page must show the blocker
    within 2 s of the heartbeat reporting it, beyond any time the tab's main thread was starved (the
    banner once waited 3-8 s behind the Live area's render on a quiet machine)."""
    from telemetry.engine_status import read_engine_status
    from telemetry.levers import defaults, write_levers_file

    page, paths = session
    page.locator('[data-testid="stSidebarNav"] a:has-text("Live")').click(force=True)
    latencies = []
    for version in (100, 102):
        page.get_by_text(BLOCKED_TEXT).first.wait_for(state="detached", timeout=60_000)
        time.sleep(2.0)      # serving again: the Live fragments redraw moving charts
        page.evaluate(_STAMP_JS)
        page.evaluate(_LAG_JS)
        write_levers_file(paths.levers, version, defaults().replace(kv_blocks_cap=1))
        deadline = time.monotonic() + 30
        while not (read_engine_status(paths.run_dir) or {}).get("is_blocked"):
            assert time.monotonic() < deadline, "the engine did not report the stall"
            time.sleep(0.02)
        reported = time.time()
        banner = page.get_by_text(BLOCKED_TEXT).first
        banner.wait_for(timeout=15_000)
        assert re.search(r"head request \d+ needs \d+ KV blocks, cap is 1", banner.inner_text())
        seen = _wait_for(lambda: page.evaluate("window.__blockedSeenAt"), 10, "the DOM stamp")
        latencies.append((seen - reported, page.evaluate("window.__lagMax") / 1000))
        _no_traceback(page)
        write_levers_file(paths.levers, version + 1, defaults())
        _wait_for(lambda: not (read_engine_status(paths.run_dir) or {}).get("is_blocked"), 60,
                  "the engine to resume")
    late = [(round(latency, 2), round(lag, 2)) for latency, lag in latencies if latency > BANNER_TARGET_S + lag]
    assert not late, (f"the blocker took (s, the tab's own timer lag in s) {late} to appear on the Live page "
                      f"(target {BANNER_TARGET_S} s beyond the lag)")
    page.get_by_text(BLOCKED_TEXT).first.wait_for(state="detached", timeout=60_000)


def test_the_levers_page_follows_pending_to_applied_without_a_reload(session):
    page, paths = session
    _nav(page, "Levers")
    toggle = page.locator('[data-testid="stCheckbox"]:has-text("bisect_no_mix")').first
    toggle.wait_for(timeout=30_000)
    toggle.locator("label").first.click()
    _wait_for(lambda: _count(paths.db, "SELECT COUNT(*) FROM lever_changes WHERE name = 'bisect_no_mix' "
                                       "AND status = 'applied' AND new IN ('true', '1')"),
              30, "the engine to apply bisect_no_mix")
    applied = page.locator('[data-testid="stMarkdownContainer"]').filter(
        has_text=re.compile(r"in sync · pending\s*True\s*· applied\s*True\s*since tick \d+"))
    applied.first.wait_for(timeout=10_000)      # no page.reload(): the page refreshes itself
    _no_traceback(page)


def test_stop_engine_from_the_dashboard_leaves_every_page_working(session):
    page, paths = session
    _nav(page, "Live")
    stop = page.get_by_role("button", name="Stop engine")
    stop.wait_for(timeout=30_000)
    stop.click()
    page.get_by_text("No engine running").first.wait_for(timeout=30_000)
    page.get_by_text(re.compile(r"run \d+: finished")).first.wait_for(timeout=15_000)
    time.sleep(3)                                 # several refreshes of every fragment
    _no_traceback(page)
    assert page.get_by_text(re.compile(r"^Engine running")).count() == 0
    for name in ("Chunks", "Requests", "Levers", "Runs", "Live"):
        _nav(page, name)
        page.wait_for_timeout(2500)
        _no_traceback(page)
