"""Shared test fixtures: seeded randomness and small models, so every test is independent of order."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# Under pytest-xdist (`make test` runs `-n auto`) each worker gets its share of the cores, so workers do not
# oversubscribe the machine with intra-op threads (which stalls small-tensor work badly).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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
