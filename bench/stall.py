"""A stalled engine: CPU while blocked, and how soon the heartbeat and the Live page name the blocker.

Starts ``python -m engine serve`` (tiny model) on a temp run dir, lets it serve,
measures its CPU share while serving, then writes ``kv_blocks_cap = 1`` (below
any queue head's need) and measures:

* seconds from the levers write until the heartbeat (``engine_status.json``)
  reports ``is_blocked`` with its blocker,
* the engine's CPU share while blocked (a re-stepping loop would be ~1.0),
* with ``--page`` (Debian chromium + Playwright): seconds from the heartbeat
  naming the blocker until the Live page shows it.

    python bench/stall.py [--measure-s 5] [--page]

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

CHROMIUM = "/usr/bin/chromium"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


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

    def seconds_until_blocker_shown(self, since: float) -> tuple[float, str]:
        banner = self.page.get_by_text("Engine blocked at tick").first
        banner.wait_for(timeout=30_000)
        return time.monotonic() - since, banner.inner_text()

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
        written = time.monotonic()
        write_levers_file(run_dir / "levers.json", 1, defaults().replace(kv_blocks_cap=1))
        status = wait_for(lambda: (s := read_engine_status(run_dir)) and s.get("is_blocked") and s,
                          "the heartbeat to report the stall")
        heartbeat_at = time.monotonic()
        to_heartbeat = heartbeat_at - written
        shown = page.seconds_until_blocker_shown(heartbeat_at) if page is not None else None
        if page is not None:
            page.close()
        blocked = cpu_share(proc.pid, args.measure_s)
        print(f"cpu: {cpu_model()}")
        print(f"engine CPU share serving {serving:.3f}, blocked {blocked:.3f} "
              f"(ratio blocked/serving {blocked / serving if serving else float('nan'):.3f}; target blocked < 0.05)")
        print(f"levers write -> heartbeat names the blocker: {to_heartbeat:.2f} s")
        print(f"blocker: {status['blocker']} ({status['num_waiting']} waiting)")
        if shown is not None:
            print(f"heartbeat names the blocker -> the open Live page shows it: {shown[0]:.2f} s "
                  f"(target <= 2 s): {shown[1][:100]}")
        write_levers_file(run_dir / "levers.json", 2, defaults())
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
