"""Fixtures for the reliability suite: engine processes on tmp run dirs, the tiny model in-process."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reliability_helpers import EngineProcess  # noqa: E402


@pytest.fixture
def start_engine(tmp_path):
    """Factory: start_engine(*serve_args, run_dir=..., log_path=...) -> EngineProcess; all killed at teardown."""
    started: list[EngineProcess] = []

    def start(*args: str, run_dir: Path | None = None, log_path: Path | None = None) -> EngineProcess:
        engine = EngineProcess(run_dir or tmp_path / "run", *args, log_path=log_path)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    from engine.model.loader import load_model
    torch.set_grad_enabled(False)
    model, _, _ = load_model("tiny")
    return model
