"""ROCm platform. torch's HIP build exposes AMD GPUs as the `cuda` device with `torch.version.hip`
set, so the CUDA worker, graph capture (hipGraph) and Triton kernels serve both; what differs is
detection and capabilities (bf16 from gfx90a/MI200 on)."""
from __future__ import annotations

import dataclasses
import functools

from corectl.platform import PlatformCaps

from ..cuda.platform import CUDAPlatform, gpu_caps

# gfx architecture prefixes of the GPUs that run bf16
_BF16_ARCHS = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


@functools.lru_cache(maxsize=1)
def _gcn_arch() -> str | None:
    import torch

    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).gcnArchName


def rocm_caps(arch: str) -> PlatformCaps:
    return _caps((8, 0) if arch.startswith(_BF16_ARCHS) else (7, 0))


def _caps(capability: tuple[int, int]) -> PlatformCaps:
    # The CUDA worker's Triton 4-bit GEMM runs here too; FP8 (e4m3fnuz on MI300) is not wired yet.
    return dataclasses.replace(gpu_caps(capability), quantization_kernels=("w4a16", "w8a16"))


class ROCmPlatform(CUDAPlatform):
    """The CUDA platform's device, worker and attention backend; its own detection and capabilities."""

    name = "rocm"

    @classmethod
    def is_available(cls) -> bool:
        try:
            return _gcn_arch() is not None
        except Exception:  # a broken runtime must read as "not available", not crash discovery
            return False

    def unavailable_reason(self) -> str:
        return "platform 'rocm' needs an AMD GPU and a ROCm (HIP) build of torch; none was found"

    def capabilities(self) -> PlatformCaps:
        return rocm_caps(_gcn_arch())

    def planned_capabilities(self, compute_capability: tuple[int, int]) -> PlatformCaps:
        """By the CUDA capability whose features the gfx target has (8.0 for bf16 ones)."""
        return _caps(compute_capability)
