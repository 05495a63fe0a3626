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


def test_a_stall_is_named_on_the_live_page(session):
    from telemetry.engine_status import read_engine_status
    from telemetry.levers import defaults, write_levers_file

    page, paths = session
    write_levers_file(paths.levers, 100, defaults().replace(kv_blocks_cap=1))
    _wait_for(lambda: (read_engine_status(paths.run_dir) or {}).get("is_blocked"), 30, "the engine to block")
    banner = page.get_by_text("Engine blocked at tick").first
    banner.wait_for(timeout=15_000)
    assert re.search(r"head request \d+ needs \d+ KV blocks, cap is 1", banner.inner_text())
    _no_traceback(page)
    write_levers_file(paths.levers, 101, defaults())
    _wait_for(lambda: not (read_engine_status(paths.run_dir) or {}).get("is_blocked"), 60, "the engine to resume")
    page.get_by_text("Engine blocked at tick").first.wait_for(state="detached", timeout=60_000)


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
