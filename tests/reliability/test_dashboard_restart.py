"""The dashboard killed and restarted while the engine serves: the engine never notices.

A real ``streamlit run dashboard/app.py`` (headless, repo config) is started,
checked healthy and loopback-only, killed with SIGKILL and started again. A lever
set through the Levers page lives in the levers file, so a fresh session after
the restart shows it, and the engine applied it.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from reliability_helpers import REPO, child_env, free_port, query, wait_for

APP = str(REPO / "dashboard" / "app.py")


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


class Dashboard:
    def __init__(self, run_dir: Path, port: int, log_path: Path) -> None:
        self.port = port
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", APP, "--server.port", str(port),
             "--server.headless", "true", "--", "--run-dir", str(run_dir)],
            cwd=REPO, env=child_env(), stdout=self._log, stderr=subprocess.STDOUT)

    def health(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/_stcore/health", timeout=2) as response:
                return response.read().decode()
        except OSError:
            return None

    def wait_healthy(self) -> None:
        wait_for(lambda: self.proc.poll() is None and self.health() == "ok" or self.proc.poll() is not None,
                 90, "dashboard health", interval_s=0.2)
        assert self.proc.poll() is None, "dashboard exited"

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


def levers_page(run_dir: Path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from dashboard.paths import ENV_RUN_DIR
    monkeypatch.setenv(ENV_RUN_DIR, str(run_dir))
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("app_pages/levers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_dashboard_killed_and_restarted_engine_does_not_notice(start_engine, tmp_path, monkeypatch):
    engine = start_engine("--rate", "8", "--kv-blocks", "64")
    db = engine.run_dir / "telemetry.db"
    port = free_port()
    dashboard = Dashboard(engine.run_dir, port, tmp_path / "dashboard1.log")
    try:
        engine.wait_tick(3)
        dashboard.wait_healthy()
        assert listening_addresses(port) <= {"0100007F", "00000000000000000000000001000000"}, \
            f"dashboard must listen on loopback only, found {listening_addresses(port)}"

        # A browser session changes a lever through the Levers page: it lands in the file.
        at = levers_page(engine.run_dir, monkeypatch)
        next(t for t in at.toggle if t.label == "bisect_no_mix").set_value(True).run()
        assert json.loads((engine.run_dir / "levers.json").read_text())["levers"] == {"bisect_no_mix": True}
        wait_for(lambda: query(db, "SELECT new FROM lever_changes WHERE name = 'bisect_no_mix' "
                                   "AND status = 'applied'"), 20, "the engine applying the lever")

        before_kill = engine.status()["tick"]
        dashboard.kill9()
        engine.wait_tick(before_kill + 5, timeout_s=60)
        dashboard = Dashboard(engine.run_dir, port, tmp_path / "dashboard2.log")
        dashboard.wait_healthy()

        # A new session (nothing carried over from the old one) sees the same lever state.
        fresh = levers_page(engine.run_dir, monkeypatch)
        assert next(t for t in fresh.toggle if t.label == "bisect_no_mix").value is True
        assert next(n for n in fresh.text_input if n.label == "slice_budget").value == "64"

        after = engine.wait_tick(engine.status()["tick"] + 3, timeout_s=60)
        assert after["telemetry"] == "ok" and after["num_dropped"] == 0
    finally:
        dashboard.kill9()
    assert engine.stop() == 0
    log = (engine.run_dir / "engine.log").read_text()
    assert " ERROR " not in log and "Traceback" not in log, log[-2000:]
    assert query(db, "SELECT status FROM runs") == [("finished",)]
    (count, distinct, high), = query(db, "SELECT count(*), count(DISTINCT tick), max(tick) FROM ticks")
    assert count == distinct == high + 1, "ticks gapless across the dashboard restart"


@pytest.fixture(autouse=True)
def _no_streamlit_config_leak(monkeypatch):
    monkeypatch.chdir(REPO)   # AppTest and streamlit read .streamlit/config.toml from here
