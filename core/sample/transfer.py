"""Host lists to device tensors without stalling the device's queue."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class DeviceTarget:
    """Where the sampler's per-step tensors go, and whether the platform can pin host memory
    (`PlatformCaps.pinned_memory`).

    A copy from pageable memory may wait for the device's queue to drain; staged through pinned
    memory it is asynchronous (torch's pinned-memory cache keeps the staging buffer alive until the
    copy has run). A device that is the host itself takes the host tensor as it is.
    """

    device: torch.device
    pinned_memory: bool = False


def to_device(data: Sequence | np.ndarray, dtype: torch.dtype, target: DeviceTarget) -> torch.Tensor:
    """Copy a (nested) Python list or a numpy array to the target device."""
    host = torch.as_tensor(data, dtype=dtype)
    if target.pinned_memory:
        host = host.pin_memory()
    return host.to(target.device, non_blocking=True)


def row_column(
    values: list, neutral: float, target: DeviceTarget, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """Per-row values as a `[B, 1]` device column, or None when every row has the neutral value
    (so the op that would use it can be skipped)."""
    if all(v == neutral for v in values):
        return None
    return to_device(values, dtype, target).unsqueeze(1)
