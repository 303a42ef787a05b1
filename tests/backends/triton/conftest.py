"""Fixtures for the Triton kernel tests (run on CPU under TRITON_INTERPRET=1, set by tests/conftest.py).

Every test draws fresh random inputs (its seed is printed, so a failure can be replayed with
KERNEL_TEST_SEED) and runs with torch's deterministic mode filling every `torch.empty` with NaN,
so an output element a kernel forgets to write fails the comparison.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
from support.close import assert_close


@pytest.fixture(autouse=True)
def fresh_random_inputs():
    seed = int(os.environ.get("KERNEL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"KERNEL_TEST_SEED={seed}")
    torch.manual_seed(seed)
    yield


@pytest.fixture(autouse=True)
def nan_filled_allocations():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture(name="assert_close")
def assert_close_fixture():
    """tests/support/close.py's check, for the kernel tests that take it as an argument."""
    return assert_close
