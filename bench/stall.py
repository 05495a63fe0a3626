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

The engine's threads are named (``prctl``) so the blocked CPU is also printed
per thread, first with no page open, then with the Live page open. With
``--page`` the dashboard logs each fragment's run time
(``CHUNKSCOPE_DASH_TIMING_LOG``); their median and maximum are printed at the
end: one browser session runs one fragment at a time, so the slowest sets how
late the stall banner can be.

    python bench/stall.py [--measure-s 5] [--page] [--rounds 3]

Targets: blocked CPU < 0.05 of a core; the Live page names the blocker within 2 s.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dashboard.fragment_timing import ENV_LOG as TIMING_ENV, read_timings  # noqa: E402
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
# The tab's own 100 ms timer, how late it fires at most: Streamlit's fragment timers share that main
# thread, so a busy tab (Plotly redraws, React) or a starved one delays the banner whatever the server does.
_LAG_JS = """() => { window.__lagMax = 0; window.__lagLast = performance.now();
  if (window.__lagTimer) return;
  window.__lagTimer = setInterval(() => { const now = performance.now();
    window.__lagMax = Math.max(window.__lagMax, now - window.__lagLast - 100); window.__lagLast = now; }, 100); }"""



# Runs ``python -m engine`` with every Python thread's OS name set to its threading name, so
# /proc/PID/task/TID/comm tells the telemetry writer from the levers watcher from the loop.
_NAMED_THREADS_ENGINE = """
import ctypes, runpy, threading
_prctl = ctypes.CDLL(None).prctl
_inner = threading.Thread._bootstrap_inner
def _named(self):
    _prctl(15, self.name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    _inner(self)
threading.Thread._bootstrap_inner = _named
runpy.run_module("engine", run_name="__main__", alter_sys=True)
"""


def _stat_cpu_seconds(stat_path: Path) -> tuple[str, float]:
    """(comm, user + system CPU seconds) from a /proc stat file."""
    text = stat_path.read_text()
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return comm, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))[1]


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread (name + tid), the live threads of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm, seconds = _stat_cpu_seconds(task / "stat")
        except (OSError, ValueError):
            continue           # the thread ended between the listing and the read
        out[f"{comm}[{task.name}]"] = seconds
    return out


def cpu_share(pid: int, seconds: float) -> float:
    before, start = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - start)


def blocked_cpu(pid: int, seconds: float) -> tuple[float, str]:
    """(the process's CPU share, its threads' shares as text, busiest first) over ``seconds``."""
    threads_before, before, start = thread_cpu_seconds(pid), cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    threads_after, total = thread_cpu_seconds(pid), cpu_seconds(pid)
    elapsed = time.monotonic() - start
    shares = sorted(((name, (threads_after[name] - threads_before.get(name, 0.0)) / elapsed)
                     for name in threads_after), key=lambda item: -item[1])
    text = ", ".join(f"{name} {share:.3f}" for name, share in shares if share > 0.0005) or "all threads < 0.001"
    return (total - before) / elapsed, text


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

    def __init__(self, run_dir: Path, timing_log: Path) -> None:
        from playwright.sync_api import sync_playwright

        port = free_port()
        self.dash = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(REPO / "dashboard" / "app.py"),
                                      "--server.headless", "true", "--server.port", str(port), "--server.address",
                                      "127.0.0.1", "--", "--run-dir", str(run_dir)], cwd=REPO,
                                     env={**os.environ, TIMING_ENV: str(timing_log)},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url), "the dashboard", 90)
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        self.page = self.browser.new_page()
        self.page.goto(url)
        self.page.locator('[data-testid="stMetricValue"]').first.wait_for(timeout=60_000)

    def arm(self) -> None:
        """Wait until no blocker is shown, then start stamping its next appearance (and the tab's lag)."""
        self.page.get_by_text(BLOCKED_TEXT).first.wait_for(state="detached", timeout=60_000)
        self.page.evaluate(_STAMP_JS)
        self.page.evaluate(_LAG_JS)

    def max_lag_s(self) -> float:
        """How late the tab's 100 ms timer fired at most since ``arm``: its main thread starved."""
        return self.page.evaluate("window.__lagMax") / 1000

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


def print_fragment_times(timing_log: Path) -> None:
    """Each dashboard fragment's run times over the bench: what the stall banner may wait behind."""
    for name, times in sorted(read_timings(timing_log).items()):
        times = sorted(times)
        print(f"dashboard {name}: {len(times)} runs, median {statistics.median(times) * 1000:.0f} ms, "
              f"p90 {times[int(0.9 * (len(times) - 1))] * 1000:.0f} ms, max {times[-1] * 1000:.0f} ms")


def block(run_dir: Path, version: int) -> tuple[dict, float, float]:
    """Write a cap no request fits under; (heartbeat status, its wall time, seconds from the write)."""
    written = time.monotonic()
    write_levers_file(run_dir / "levers.json", version, defaults().replace(kv_blocks_cap=1))
    status = wait_for(lambda: (s := read_engine_status(run_dir)) and s.get("is_blocked") and s,
                      "the heartbeat to report the stall")
    return status, time.time(), time.monotonic() - written


def unblock(run_dir: Path, version: int) -> None:
    write_levers_file(run_dir / "levers.json", version, defaults())
    wait_for(lambda: not (read_engine_status(run_dir) or {}).get("is_blocked"), "the stall to clear")
    time.sleep(3.0)     # serving again: the Live page redraws moving charts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-s", type=float, default=5.0, help="CPU sampling window, seconds")
    parser.add_argument("--page", action="store_true", help="also time the Live page (needs chromium)")
    parser.add_argument("--rounds", type=int, default=1, help="block / unblock this many times")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="chunkscope-stall-")) / "run"
    timing_log = run_dir.parent / "dashboard_timing.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _NAMED_THREADS_ENGINE, "serve", "--model", "tiny", "--run-dir",
                             str(run_dir), "--rate", "20", "--seed", "3"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    page = None
    try:
        wait_for(lambda: (read_engine_status(run_dir) or {}).get("tick", 0) > 20, "the engine to serve")
        serving = cpu_share(proc.pid, args.measure_s)
        print(f"cpu: {cpu_model()}")
        print(f"engine CPU share serving {serving:.3f} (load average {os.getloadavg()[0]:.1f})")
        status, _, _ = block(run_dir, 1)
        blocked, threads = blocked_cpu(proc.pid, args.measure_s)
        print(f"no page open: engine CPU share blocked {blocked:.3f} (ratio blocked/serving "
              f"{blocked / serving if serving else float('nan'):.3f}; target < 0.05; {status['num_waiting']} "
              f"waiting; load average {os.getloadavg()[0]:.1f}); per thread: {threads}")
        print(f"blocker: {status['blocker']}")
        unblock(run_dir, 2)
        page = LivePage(run_dir, timing_log) if args.page else None
        version = 2
        for round_no in range(1, args.rounds + 1):
            if page is not None:
                page.arm()
            status, heartbeat_wall, to_heartbeat = block(run_dir, version := version + 1)
            shown = page.seconds_until_blocker_shown(heartbeat_wall) if page is not None else None
            load = os.getloadavg()[0]
            if round_no == 1 and page is not None:
                blocked, threads = blocked_cpu(proc.pid, args.measure_s)
                print(f"Live page open: engine CPU share blocked {blocked:.3f} (target < 0.05; "
                      f"{status['num_waiting']} waiting; load average {os.getloadavg()[0]:.1f}); per thread: "
                      f"{threads}")
            line = (f"round {round_no} (load average {load:.1f}): levers write -> heartbeat names the blocker "
                    f"{to_heartbeat:.2f} s")
            if shown is not None:
                line += (f"; heartbeat -> the open Live page shows it {shown[0]:.2f} s in the DOM, "
                         f"{shown[1]:.2f} s as Playwright noticed (target <= 2 s); the tab's timer up to "
                         f"{page.max_lag_s():.2f} s late")
            print(line)
            unblock(run_dir, version := version + 1)
    finally:
        if page is not None:
            page.close()
            print_fragment_times(timing_log)
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
