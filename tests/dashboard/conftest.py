"""Fixtures: a short real engine run, and a synthetic store for scale and edge cases.

``real_run`` (session): ``python -m engine serve`` on the tiny model wrote its
run directory (``real_run.py``); tests query its database with plain SQL for
the expected numbers. ``run_fixture``: a synthetic store written by the real
telemetry writer, run 1 finished and run 2 crashed, with the events kept in
memory so tests compute expected numbers independently of the dashboard's SQL.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import real_run  # noqa: E402
import synthetic_run  # noqa: E402

from dashboard.paths import ENV_RUN_DIR  # noqa: E402

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
RUN1 = synthetic_run.SimConfig()
RUN2 = synthetic_run.SimConfig(num_requests=12, seed=7, max_prefill_tokens=64, bisect_on_tick=10_000)


class RunFixture:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.db = run_dir / "telemetry.db"
        self.events = list(synthetic_run.simulate(RUN1))
        self.events2 = list(synthetic_run.simulate(RUN2))
        self.run1 = synthetic_run.write_run(self.db, RUN1, status="finished")
        self.run2 = synthetic_run.write_run(self.db, RUN2, status="crashed")

    def of(self, type_name: str, events=None) -> list:
        return [e for e in (events or self.events) if type(e).__name__ == type_name]

    def final_requests(self, events=None) -> dict:
        """request_id -> last RequestRecord (what the upserted requests table holds)."""
        return {r.request_id: r for r in self.of("RequestRecord", events)}

    def counter(self, type_name: str, attr: str, events=None) -> collections.Counter:
        return collections.Counter(getattr(e, attr) for e in self.of(type_name, events))


@pytest.fixture(scope="session")
def run_fixture(tmp_path_factory) -> RunFixture:
    return RunFixture(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="session")
def real_run_dir(tmp_path_factory) -> real_run.RealRun:
    return real_run.run_engine(tmp_path_factory.mktemp("real") / "run")


@pytest.fixture
def real_app(real_run_dir, app):
    """Like ``app``, on the real engine run's directory (its only run, "latest")."""
    def open_page(page: str | None = None) -> "AppTest":  # noqa: F821
        return app(page, run_dir=real_run_dir.run_dir, run_id=None)
    return open_page


@pytest.fixture
def app(run_fixture, monkeypatch):
    """An AppTest on the fixture's run dir; pass a page name to open it."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv(ENV_RUN_DIR, str(run_fixture.run_dir))

    def open_page(page: str | None = None, run_dir: Path | None = None, run_id: int | None = 1) -> AppTest:
        if run_dir is not None:
            monkeypatch.setenv(ENV_RUN_DIR, str(run_dir))
        at = AppTest.from_file(APP, default_timeout=30)
        if run_id is not None:
            at.session_state["chosen_run"] = run_id
        at.run()
        if page is not None:
            at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        return at
    return open_page
