"""CPU platform: always available; bf16 by default where the CPU has native bf16 instructions."""
from __future__ import annotations

import functools
import os
from pathlib import Path

from corectl.platform import Platform, PlatformCaps


@functools.lru_cache(maxsize=1)
def has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 (bf16 decode is ~1.65x fp32 there); elsewhere bf16 is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class CPUPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    on_host = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def capabilities(self) -> PlatformCaps:
        return PlatformCaps(
            dtypes=("float32", "bfloat16"),
            default_dtype="bfloat16" if has_native_bf16() else "float32",
            sampling_draw="inverse_cdf",
            quantization_kernels=("cpu_int4pack",),
        )

    def device_memory(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def distributed_backend(self) -> str:
        return "gloo"

    def device_for_rank(self, local_rank: int):
        import torch

        return torch.device("cpu")  # the ranks share the host's one device (and split its cores)

    def ray_resources_per_rank(self) -> dict[str, float]:
        return {"CPU": 1.0}

    def worker_cls(self):
        from .worker import CPUWorker

        return CPUWorker

    def default_attention_backend(self, model_config) -> str:
        return "torch_sdpa"
