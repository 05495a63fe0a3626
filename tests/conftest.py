"""Shared pytest options: GPU tests are opt-in with --gpu."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", default=False, help="run tests that need a CUDA device")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: pass --gpu on a machine with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
