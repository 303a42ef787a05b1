"""Host lists to device tensors without stalling the device's queue."""
from __future__ import annotations

import torch


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a (nested) Python list to `device`.

    A plain `torch.tensor(..., device=cuda)` copies from pageable memory, which waits for the
    device's queue to drain; staging through pinned memory makes the copy asynchronous (torch's
    pinned-memory cache keeps the staging buffer alive until the copy has run).
    """
    host = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
