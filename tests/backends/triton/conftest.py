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

# bf16 keeps 8 significant bits: one rounding moves a value by at most 2**-7 of itself, and the
# interpreter truncates instead of rounding, so kernel and reference may each be a step off.
BF16_STEP = 2.0 ** -7


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


def _assert_close(out: torch.Tensor, ref: torch.Tensor, roundings: int = 1) -> None:
    """Compare with the reference: fp32 to rounding noise; 16-bit within `roundings` dtype steps."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} elements unwritten or not finite"
    if out.dtype == torch.float32:
        rtol, atol = 2e-5, 2e-5
    else:
        step = BF16_STEP if out.dtype == torch.bfloat16 else 2.0 ** -10
        rtol, atol = roundings * step, 1e-4
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.fixture
def assert_close():
    return _assert_close
