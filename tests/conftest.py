"""Shared test fixtures: seeded randomness and small models, so every test is independent of order."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from hypothesis import settings

# Property tests explore new random examples on every local run; CI (`.ci/run`) sets HYPOTHESIS_PROFILE=ci, which
# fixes the examples per code version, so a submission's CI result does not depend on the draw. A failure found
# locally prints its seed and a @reproduce_failure blob either way.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    """The slow tests first (the tour, the notebooks, the grading runs: a few hundred seconds each at most), then the
    rest in file order. With `make test`'s `-n auto --maxschedchunk 1`, pytest-xdist hands tests out one or two at a
    time in this order, so the long ones start early on every worker and the short ones fill the gaps at the end;
    in file order the notebooks came last and one worker could finish minutes after the other. The order changes no
    result: every test seeds its own randomness and builds its own models."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") or item.get_closest_marker("notebook") else 1)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One torch thread for the whole suite. Test models are tiny, so a second thread buys nothing, and where cores
    are shared (pytest-xdist workers, a busy machine) OpenMP threads waiting on each other make small ops many times
    slower. No test measures speed, so this changes no result."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every test that takes `device` runs on the CPU, and on CUDA too when a GPU is present."""
    return torch.device(request.param)
