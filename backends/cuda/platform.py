"""CUDA platform: detection and capabilities read from the device, never assumed."""
from __future__ import annotations

import functools

from corectl.platform import Platform, PlatformCaps


@functools.lru_cache(maxsize=1)
def _device_capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)


def gpu_caps(capability: tuple[int, int], notes: tuple[str, ...] = ()) -> PlatformCaps:
    """Capabilities of a GPU from its compute capability (shared with ROCm, whose torch maps gfx
    targets onto the same query)."""
    bf16 = capability >= (8, 0)
    return PlatformCaps(
        dtypes=("bfloat16", "float16", "float32") if bf16 else ("float16", "float32"),
        default_dtype="bfloat16" if bf16 else "float16",
        graphs=True,
        pinned_memory=True,
        profiles_memory=True,
        fp8=capability >= (8, 9),
        async_output=True,
        notes=notes,
    )


class CUDAPlatform(Platform):
    name = "cuda"
    device_type = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch

            return torch.version.hip is None and _device_capability() is not None
        except Exception:  # a broken driver must read as "not available", not crash discovery
            return False

    def unavailable_reason(self) -> str:
        return "platform 'cuda' needs an NVIDIA GPU and a CUDA build of torch; none was found"

    def capabilities(self) -> PlatformCaps:
        return gpu_caps(_device_capability())

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name(0)

    def worker_cls(self):
        from .worker import CUDAWorker

        return CUDAWorker

    def default_attention_backend(self, model_config) -> str:
        return "triton"
