"""Host lists to device tensors without stalling the device's queue."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def to_device(data: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a (nested) Python list or a numpy array to `device`.

    A plain `torch.tensor(..., device=cuda)` copies from pageable memory, which waits for the
    device's queue to drain; staging through pinned memory makes the copy asynchronous (torch's
    pinned-memory cache keeps the staging buffer alive until the copy has run).
    """
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def row_column(
    values: list, neutral: float, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """Per-row values as a `[B, 1]` device column, or None when every row has the neutral value
    (so the op that would use it can be skipped)."""
    if all(v == neutral for v in values):
        return None
    return to_device(values, dtype, device).unsqueeze(1)
