"""The row-padding choice of cuBLAS GEMMs (corectl.backends.triton.gemm.padded_rows) off the GPU:
which row counts are tried, what wins, and that nothing is decided or padded outside a capture's tuning."""
import pytest
import torch
from corectl.backends.triton.gemm import padded_rows
from corectl.backends.triton.layer_kernels import triton_layer_kernels


@pytest.mark.parametrize(("m", "expected"), [(320, [320, 384]), (48, [48, 64, 128]), (200, [200, 256]),
                                             (128, [128]), (64, [64, 128]), (1, [1, 64, 128])])
def test_candidates_are_the_count_and_its_next_aligned_counts(m, expected):
    assert padded_rows.candidates(m) == expected


def test_a_padded_count_wins_only_by_the_margin():
    assert padded_rows.choose({320: 0.038, 384: 0.029}) == 384
    assert padded_rows.choose({320: 0.030, 384: 0.029}) == 320
    assert padded_rows.choose({48: 0.020, 64: 0.017, 128: 0.015}) == 128
    assert padded_rows.choose({48: 0.010, 64: 0.011, 128: 0.012}) == 48


def test_no_decision_and_no_padding_outside_tuning():
    x, w = torch.randn(320, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16)
    decided = dict(padded_rows._decisions)
    assert padded_rows.linear(x, w, None) is None
    # The layer kernels' dense GEMM leaves a 320-row bf16 layer to F.linear here.
    assert triton_layer_kernels().dense_linear(x, w, None, False) is None
    assert padded_rows._decisions == decided


def test_the_switch_turns_tuning_off(monkeypatch):
    monkeypatch.setenv("CORECTL_GEMM_ROW_PADDING", "0")
    with padded_rows.tuning():
        assert not padded_rows._tuning
    monkeypatch.setenv("CORECTL_GEMM_ROW_PADDING", "1")
    with padded_rows.tuning():
        assert padded_rows._tuning
    assert not padded_rows._tuning
