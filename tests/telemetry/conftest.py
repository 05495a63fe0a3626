"""Fixtures for the telemetry tests."""
import pytest


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "telemetry.db")
