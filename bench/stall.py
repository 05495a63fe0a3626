"""A stalled engine: CPU while blocked, and how soon the heartbeat and the Live page name the blocker.

Starts ``python -m engine serve`` (tiny model) on a temp run dir, lets it serve,
measures its CPU share while serving, then writes ``kv_blocks_cap = 1`` (below
any queue head's need) and measures:

* seconds from the levers write until the heartbeat (``engine_status.json``)
  reports ``is_blocked`` with its blocker,
* the engine's CPU share while blocked (a re-stepping loop would be ~1.0),
* with ``--page`` (Debian chromium + Playwright): seconds from the heartbeat
  naming the blocker until the Live page shows it, read two ways: when the text
  entered the page's DOM (a MutationObserver stamps it with the browser's clock,
  the same wall clock as ours: what a user sees) and when Playwright's own
  polling noticed it (later by the test driver's lag on a loaded machine).
  ``--rounds N`` blocks and unblocks N times on the same engine and page.

    python bench/stall.py [--measure-s 5] [--page] [--rounds 3]

Targets: blocked CPU < 0.05 of a core; the Live page names the blocker within 2 s.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry.engine_status import read_engine_status  # noqa: E402
from telemetry.levers import defaults, write_levers_file  # noqa: E402
from engine.model.cpu_features import cpu_model  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
BLOCKED_TEXT = "Engine blocked at tick"
# Stamps (browser wall clock, s) the first time the blocker text is in the page since the last reset.
_STAMP_JS = """() => { window.__blockedSeenAt = null;
  if (window.__stampObserver) return;
  window.__stampObserver = new MutationObserver(() => {
    if (window.__blockedSeenAt === null && document.body.innerText.includes('%s')) {
      window.__blockedSeenAt = Date.now() / 1000; } });
  window.__stampObserver.observe(document.body, {subtree: true, childList: true, characterData: true}); }""" % BLOCKED_TEXT



def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, seconds: float) -> float:
    before, start = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - start)


def wait_for(condition, what: str, timeout_s: float = 120.0, step_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step_s)
    raise SystemExit(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LivePage:
    """The dashboard served on ``run_dir`` and one chromium tab on its Live page."""

    def __init__(self, run_dir: Path) -> None:
        from playwright.sync_api import sync_playwright

        port = free_port()
        self.dash = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(REPO / "dashboard" / "app.py"),
                                      "--server.headless", "true", "--server.port", str(port), "--server.address",
                                      "127.0.0.1", "--", "--run-dir", str(run_dir)], cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url), "the dashboard", 90)
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        self.page = self.browser.new_page()
        self.page.goto(url)
        self.page.locator('[data-testid="stMetricValue"]').first.wait_for(timeout=60_000)

    def arm(self) -> None:
        """Wait until no blocker is shown, then start stamping its next appearance."""
        self.page.get_by_text(BLOCKED_TEXT).first.wait_for(state="detached", timeout=60_000)
        self.page.evaluate(_STAMP_JS)

    def seconds_until_blocker_shown(self, since_wall: float) -> tuple[float, float, str]:
        """(DOM latency, Playwright latency, banner text), both from ``since_wall`` (time.time())."""
        banner = self.page.get_by_text(BLOCKED_TEXT).first
        banner.wait_for(timeout=30_000)
        noticed = time.time()
        in_dom = wait_for(lambda: self.page.evaluate("window.__blockedSeenAt"), "the DOM stamp", 10)
        return in_dom - since_wall, noticed - since_wall, banner.inner_text()

    def close(self) -> None:
        self.browser.close()
        self.pw.stop()
        self.dash.terminate()
        self.dash.wait(10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-s", type=float, default=5.0, help="CPU sampling window, seconds")
    parser.add_argument("--page", action="store_true", help="also time the Live page (needs chromium)")
    parser.add_argument("--rounds", type=int, default=1, help="block / unblock this many times")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="chunkscope-stall-")) / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                             "--rate", "20", "--seed", "3"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (read_engine_status(run_dir) or {}).get("tick", 0) > 20, "the engine to serve")
        serving = cpu_share(proc.pid, args.measure_s)
        page = LivePage(run_dir) if args.page else None
        print(f"cpu: {cpu_model()}")
        version = 0
        try:
            for round_no in range(1, args.rounds + 1):
                if page is not None:
                    page.arm()
                version += 1
                written = time.monotonic()
                write_levers_file(run_dir / "levers.json", version, defaults().replace(kv_blocks_cap=1))
                status = wait_for(lambda: (s := read_engine_status(run_dir)) and s.get("is_blocked") and s,
                                  "the heartbeat to report the stall")
                heartbeat_wall, to_heartbeat = time.time(), time.monotonic() - written
                shown = page.seconds_until_blocker_shown(heartbeat_wall) if page is not None else None
                load = os.getloadavg()[0]
                if round_no == 1:
                    blocked = cpu_share(proc.pid, args.measure_s)
                    print(f"engine CPU share serving {serving:.3f}, blocked {blocked:.3f} (ratio blocked/serving "
                          f"{blocked / serving if serving else float('nan'):.3f}; target blocked < 0.05)")
                    print(f"blocker: {status['blocker']} ({status['num_waiting']} waiting)")
                line = (f"round {round_no} (load average {load:.1f}): levers write -> heartbeat names the blocker "
                        f"{to_heartbeat:.2f} s")
                if shown is not None:
                    line += (f"; heartbeat -> the open Live page shows it {shown[0]:.2f} s in the DOM, "
                             f"{shown[1]:.2f} s as Playwright noticed (target <= 2 s)")
                print(line)
                version += 1
                write_levers_file(run_dir / "levers.json", version, defaults())
                wait_for(lambda: not (read_engine_status(run_dir) or {}).get("is_blocked"), "the stall to clear")
                time.sleep(3.0)     # serving again: the Live page redraws moving charts
        finally:
            if page is not None:
                page.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
