"""Real browser, a newcomer's first hour (issue 29, items 1, 5, 6, 7, 9, 11): ``./run.sh`` as the README
says, chromium at 1280 px on the pages it serves.

One session for every check (the costly parts are the engine, the dashboard and the browser): ``./run.sh``
starts on a run directory whose levers file an earlier run left behind, then, in order,

* Levers: the carried-over levers are named in a warning, every lever row of the table is in view, a
  10 kB invalid value comes back cut to one line, a lever change draws no Streamlit warning, and
  "Reset to defaults" writes the defaults (the warning goes);
* Runs: "from s" rejects -5 with a message and the Build button is disabled;
* Chunks and Requests: the columns each page is about are in view at 1280 px, the rest named in a caption;
  two picked blocker chips are both shown;
* last, the engine is killed with SIGKILL while the Live page is open: the dashboard stays up, says the run
  crashed (never a green "running"), every page still reads the run, the engine restarts from the page,
  and Ctrl-C to ./run.sh stops the dashboard and the restarted engine.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dashboard.queries.chunks import NO_BLOCKER
from telemetry.events import BLOCK_NO_DECODES
from test_browser import ROOT, _count, _free_port, _healthy, _skip_reason, _wait_for, chromium_browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WIDTH = 1280
CARRIED = {"slice_budget": 32}          # an earlier run's levers file, still in the run directory
LONG_VALUE = "9x" * 5_000               # a 10 kB invalid lever value
FRAGMENT_WARNING = "A fragment rerun was triggered with a callback"
# The table whose columns in view include ``header``: glide's accessible table holds the columns in view
# (and no more) as <th>, in order, and the rows in view as <tr>.
_TABLE_JS = """(header) => { for (const frame of document.querySelectorAll('[data-testid="stDataFrame"]')) {
  const headers = [...frame.querySelectorAll('th')].map(t => t.innerText.trim());
  if (!headers.includes(header)) continue;
  const box = frame.getBoundingClientRect(), scroller = frame.querySelector('.dvn-scroller');
  return {headers, rows: frame.querySelectorAll('tbody tr').length, width: box.width,
          scroll_width: scroller.scrollWidth, scroll_height: scroller.scrollHeight,
          client_height: scroller.clientHeight}; }
  return null; }"""
# Every table's rows in view and whether it scrolls up and down.
_TABLE_ROWS_JS = """() => [...document.querySelectorAll('[data-testid="stDataFrame"]')].map(frame => {
  const scroller = frame.querySelector('.dvn-scroller');
  return [frame.querySelectorAll('tbody tr').length, scroller.scrollHeight > scroller.clientHeight + 1]; })"""


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


class Session:
    def __init__(self, proc: subprocess.Popen, url: str, run_dir: Path, page, log: Path, api_url: str) -> None:
        self.proc, self.url, self.run_dir, self.page, self.log = proc, url, run_dir, page, log
        self.api_url = api_url

    def api_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.api_url + "/v1/models", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    @property
    def db(self) -> Path:
        return self.run_dir / "telemetry.db"

    @property
    def levers(self) -> Path:
        return self.run_dir / "levers.json"

    def engine_pid(self) -> int | None:
        pids = [p for p in _children(self.proc.pid) if "engine serve" in _cmdline(p)]
        return pids[0] if pids else None

    def open(self, name: str) -> None:
        self.page.goto(self.url if name == "Live" else f"{self.url}/{name.lower()}")
        self.page.locator("h1").filter(has_text=name).first.wait_for(timeout=60_000)

    def nav(self, name: str) -> None:
        # force: live fragments redraw every second, so the sidebar link is rarely "stable" for Playwright
        self.page.locator(f'[data-testid="stSidebarNav"] a:has-text("{name}")').click(force=True)
        self.page.locator("h1").filter(has_text=name).first.wait_for(timeout=60_000)

    def no_traceback(self) -> None:
        found = self.page.locator('[data-testid="stException"]')
        assert found.count() == 0, found.first.inner_text()

    def table(self, header: str) -> dict:
        return _wait_for(lambda: self.page.evaluate(_TABLE_JS, header), 60, f"a table with a {header!r} column")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("./run.sh needs the project's .venv (./run.sh setup creates it)")
    from telemetry.levers import write_levers_file

    tmp = tmp_path_factory.mktemp("newcomer")
    run_dir = tmp / "run"
    run_dir.mkdir()
    write_levers_file(run_dir / "levers.json", 3, CARRIED)
    time.sleep(0.05)         # the file is older than the run the engine starts
    port, api_port, log = _free_port(), _free_port(), tmp / "run_sh.log"
    env = {**os.environ, "PORT": str(port), "API_PORT": str(api_port), "RUN_DIR": str(run_dir),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["./run.sh"], cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _healthy(url), 120, "./run.sh's dashboard to serve")
        _wait_for(lambda: _count(run_dir / "telemetry.db", "SELECT COUNT(*) FROM chunks") > 20, 120,
                  "the engine's first chunk decisions")
        with chromium_browser() as browser:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            yield Session(proc, url, run_dir, page, log, f"http://127.0.0.1:{api_port}")
    finally:
        from dashboard import engine_control
        from dashboard.paths import RunPaths

        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        engine_control.stop_engine(RunPaths(run_dir), timeout_s=15)    # one the page restarted


def test_levers_page_carry_over_long_value_no_warning_and_reset(session):
    """Items 9, 7, 11 and 5 (the Levers table shows every row)."""
    from telemetry.levers import LEVERS, defaults

    s = session
    s.open("Levers")
    page = s.page
    carried = page.get_by_text("Levers carried over from an earlier run").first
    carried.wait_for(timeout=60_000)
    assert "slice_budget = 32" in carried.inner_text()

    table = s.table("lever")
    assert table["scroll_height"] <= table["client_height"] + 1, f"the levers table scrolls: {table}"
    assert table["rows"] == len(LEVERS), f"{table['rows']} of {len(LEVERS)} lever rows in view"

    box = page.get_by_role("textbox", name="max_prefill_tokens", exact=True)
    box.fill(LONG_VALUE)
    box.press("Enter")
    error = page.locator('[data-testid="stAlert"]').filter(has_text="max_prefill_tokens: not written").first
    error.wait_for(timeout=30_000)
    text = error.inner_text()
    assert len(text) < 300 and "10,000 characters" in text and "is not an integer" in text, text
    height = error.bounding_box()["height"]
    assert height < 120, f"the error is {height:.0f} px tall: {text[:200]}"

    before = json.loads(s.levers.read_text())
    toggle = page.locator('[data-testid="stCheckbox"]:has-text("bisect_no_mix")').first
    toggle.locator("label").first.click()
    page.get_by_text(re.compile(r"bisect_no_mix = True written to levers\.json")).first.wait_for(timeout=30_000)
    page.wait_for_timeout(2500)          # refreshes after the write: the redrawn widgets write nothing
    after = json.loads(s.levers.read_text())
    assert after == {"version": before["version"] + 1, "levers": {**CARRIED, "bisect_no_mix": True}}, \
        f"one change, one write: {before} -> {after}"
    assert FRAGMENT_WARNING not in page.locator("body").inner_text()
    assert FRAGMENT_WARNING not in s.log.read_text(errors="replace")

    page.get_by_role("button", name="Reset to defaults").click()
    _wait_for(lambda: json.loads(s.levers.read_text())["levers"] == defaults().as_dict(), 30,
              "levers.json to hold every default")
    carried.wait_for(state="detached", timeout=30_000)
    assert FRAGMENT_WARNING not in s.log.read_text(errors="replace")
    s.no_traceback()


def test_runs_page_from_s_rejects_a_negative(session):
    """Item 9: "from s" -5 gets a message and no bundle can be built from it; item 5: the lever settings
    table shows every lever."""
    from telemetry.levers import LEVERS

    s = session
    s.open("Runs")
    _wait_for(lambda: [len(LEVERS), False] in s.page.evaluate(_TABLE_ROWS_JS), 60,
              f"a table of all {len(LEVERS)} levers in view without a scroll")
    box = s.page.get_by_role("spinbutton", name="from s (optional)")
    box.fill("-5")
    box.press("Enter")
    s.page.get_by_text("from s must be 0 or more").first.wait_for(timeout=30_000)
    assert s.page.get_by_role("button", name=re.compile("Build bundle")).is_disabled()
    box.fill("")
    box.press("Enter")
    s.page.get_by_text("from s must be 0 or more").first.wait_for(state="detached", timeout=30_000)


def test_the_columns_a_page_is_about_are_in_view_at_1280_px(session):
    """Item 5 (Chunks, Requests, the Live latency table) and item 6 (both picked blocker chips shown)."""
    s = session
    s.open("Chunks")
    table = s.table("mix_blocker")
    assert table["headers"][:5] == ["tick", "request_id", "path", "can_mix", "mix_blocker"], table
    hint = s.page.get_by_text(re.compile(r"^Scroll the table sideways for .*kv_quant_state")).first
    hint.wait_for(timeout=30_000)

    # the two chips, then two more: every one stays inside the box (the box grows)
    picked = ("speculation", "bisect_no_mix", NO_BLOCKER, BLOCK_NO_DECODES)
    blockers = s.page.locator(".st-key-chunks_blocker")
    for chip in picked:
        s.page.get_by_role("combobox", name="can-mix blocker").click()
        s.page.get_by_role("option", name=chip, exact=True).click()
        s.page.keyboard.press("Escape")
        s.page.get_by_text(re.compile(f"blocker is .*{re.escape(chip)}")).first.wait_for(timeout=30_000)
    box = blockers.locator('.react-aria-ComboBox [role="group"]').first.bounding_box()
    tags = blockers.locator(".react-aria-ComboBox [data-tag]")
    assert [t.inner_text().strip() for t in tags.all()] == list(picked)
    for chip, tag in zip(picked, tags.all()):
        tag_box = tag.bounding_box()
        assert box["x"] <= tag_box["x"] and tag_box["x"] + tag_box["width"] <= box["x"] + box["width"] + 1 and \
            box["y"] <= tag_box["y"] and tag_box["y"] + tag_box["height"] <= box["y"] + box["height"] + 1, \
            f"the {chip} chip {tag_box} lies outside its box {box}"
    s.page.get_by_text("blocker is speculation or bisect_no_mix or").first.wait_for(timeout=30_000)

    s.nav("Requests")
    table = s.table("TTFT (ms)")
    wanted = ["TTFT (ms)", "e2e (ms)", "finish", "first_token_rules", "grammar"]
    assert all(h in table["headers"] for h in wanted), table
    s.page.get_by_text(re.compile(r"^Scroll the table sideways for .*prefix miss reason")).first.wait_for(
        timeout=30_000)

    s.nav("Live")
    latency = s.table("p50_ms")
    assert latency["headers"][-1] == "count" and latency["scroll_width"] <= latency["width"], latency
    s.no_traceback()


def test_the_dashboard_outlives_a_killed_engine(session):
    """Item 1: SIGKILL the engine ./run.sh started while the Live page is open."""
    s = session
    page = s.page
    s.open("Live")
    page.locator('[data-testid="stMetricValue"]').first.wait_for(timeout=60_000)
    pid = s.engine_pid()
    assert pid is not None, "no engine child of ./run.sh"
    frontends = [p for p in _children(pid)]       # the engine's API process
    os.kill(pid, signal.SIGKILL)
    crashed = page.get_by_text(re.compile(r"No engine running: run 1 crashed")).first
    crashed.wait_for(timeout=30_000)
    page.get_by_text("run 1: crashed").first.wait_for(timeout=30_000)
    page.get_by_text(re.compile(r"^Engine crashed: run 1 \(pid \d+\) died at tick \d+")).first.wait_for(
        timeout=30_000)
    time.sleep(3)                                 # several refreshes of every fragment
    assert s.proc.poll() is None, "./run.sh exited with the engine"
    assert _healthy(s.url), "the dashboard stopped with the engine"
    assert page.get_by_text(re.compile(r"^Engine running")).count() == 0, "a green 'running' for a crashed run"
    assert "engine crashed (exit 137)" in s.log.read_text(errors="replace")
    s.no_traceback()

    for name, body in (("Chunks", "chunk decisions"), ("Requests", "requests"), ("Levers", "in sync"),
                       ("Runs", "crashed")):
        s.nav(name)
        page.get_by_text(re.compile(body)).first.wait_for(timeout=60_000)
        page.get_by_text(re.compile(r"^Engine crashed: run 1")).first.wait_for(timeout=30_000)
        s.no_traceback()

    s.nav("Live")
    page.get_by_role("button", name="Restart engine").click()
    _wait_for(lambda: _count(s.db, "SELECT COUNT(*) FROM runs WHERE run_id = 2 AND status = 'running'"), 120,
              "the restarted engine's run 2")
    page.get_by_text(re.compile(r"^Engine running \(pid \d+, started from this dashboard\)")).first.wait_for(
        timeout=60_000)
    page.get_by_text(re.compile(r"^Engine crashed")).first.wait_for(state="detached", timeout=30_000)
    restarted = json.loads((s.run_dir / "engine.pid").read_text())["pid"]
    # ./run.sh's engine served the API: the restarted one serves it on the same port, where clients are.
    _wait_for(s.api_answers, 60, "the restarted engine's API on ./run.sh's API port")

    s.proc.send_signal(signal.SIGINT)             # Ctrl-C stops the dashboard and the restarted engine
    assert s.proc.wait(60) == 0, s.log.read_text(errors="replace")[-2000:]
    assert _is_gone(restarted), f"the restarted engine outlived Ctrl-C: {s.log.read_text(errors='replace')[-2000:]}"
    assert not _healthy(s.url)
    assert _count(s.db, "SELECT COUNT(*) FROM runs WHERE run_id = 2 AND status = 'finished'") == 1
    for orphan in frontends:                      # the killed engine's API process, if it outlived it
        if not _is_gone(orphan) and "engine" in _cmdline(orphan):
            os.kill(orphan, signal.SIGKILL)
