"""How near a result must be to its reference: one check for every numeric test.

bf16 keeps 8 significant bits: one rounding moves a value by at most 2**-7 of itself (fp16: 2**-10),
and Triton's interpreter truncates instead of rounding, so kernel and reference may each be a step off.
"""
from __future__ import annotations

import math

import torch

BF16_STEP = 2.0 ** -7
FP16_STEP = 2.0 ** -10


def relative_error(got: torch.Tensor, expected: torch.Tensor, norm: str = "fro") -> float:
    """|got - expected| / |expected| in the Frobenius norm, or with norm="max" the largest element's
    error over the largest reference element (a bound on every element's error)."""
    order = {"fro": 2, "max": math.inf}[norm]
    diff, ref = got.float() - expected.float(), expected.float()
    return (torch.linalg.vector_norm(diff, order) / torch.linalg.vector_norm(ref, order)).item()


def assert_close(got: torch.Tensor, expected: torch.Tensor, tol: float | None = None, *, norm: str = "fro",
                 roundings: int = 1) -> None:
    """`got` has the reference's shape, no unwritten or non-finite element, and matches it: within a
    `relative_error` of `tol` when given; else to `got`'s dtype, fp32 to rounding noise and 16-bit
    within `roundings` steps of the dtype."""
    assert got.shape == expected.shape, f"shape {tuple(got.shape)} != reference {tuple(expected.shape)}"
    assert torch.isfinite(got).all(), f"{(~torch.isfinite(got)).sum().item()} elements unwritten or not finite"
    if tol is not None:
        error = relative_error(got, expected, norm)
        assert error <= tol, f"relative error ({norm}) {error:.3g} > {tol}"
        return
    if got.dtype == torch.float32:
        rtol, atol = 2e-5, 2e-5
    else:
        rtol, atol = roundings * (BF16_STEP if got.dtype == torch.bfloat16 else FP16_STEP), 1e-4
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=atol)
