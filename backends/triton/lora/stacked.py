"""Batch-1 LoRA shrink inside the base GEMV: a layer whose adapters' A rows are stacked under its
weight ([N + S n R, K], corectl.lora.layers) computes its output and every slot's x @ A.T in one
launch, so a batch-1 decode step runs the expand alone (no shrink launch: at batch 1 each launch
costs more than the bytes it moves)."""
from __future__ import annotations

import torch

from ..gemm.fp8_gemv import dense_gemv
from ..gemm.gemv_configs import dense_decode_config


def lora_stacked_linear(x: torch.Tensor, stacked: torch.Tensor, bias: torch.Tensor | None, base_rows: int,
                        gated: bool = False) -> torch.Tensor | None:
    """x [M, K] @ stacked [N', K].T + bias [N'] by the dense GEMV with the config of the base
    layer's own [base_rows, K] (the rows past it are a few percent more), or None where the base
    layer would not take the GEMV either (that shape and batch run faster in cuBLAS): the caller
    then runs the base and the shrink. `gated`: x is [M, 2K] (gate | up), silu(gate) * up in its place."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or stacked.dtype != x.dtype:
        return None
    config = dense_decode_config(x.shape[0], base_rows, stacked.shape[1], gated, x.device)
    return None if config is None else dense_gemv(x, stacked, bias, config, gated)
