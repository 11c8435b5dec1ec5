"""Shared pytest setup: tests run on CPU with fixed seeds and single-threaded BLAS-free noise.

Run everything: `pytest`. Parity tests live in tests/parity/ and skip (with the reason) when a
reference library is missing; `pip install -e ".[test]"` installs the pinned reference versions.
"""

import os

import pytest
import torch

# Deterministic, and kind to a 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield
