"""CUDA platform: detection and capabilities read from the device, never assumed."""
from __future__ import annotations

import dataclasses
import functools

from corectl.platform import Platform, PlatformCaps


@functools.lru_cache(maxsize=1)
def _device_capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)


def gpu_caps(capability: tuple[int, int]) -> PlatformCaps:
    """Capabilities of a GPU from its compute capability (shared with ROCm, which passes the
    capability whose features its gfx target has)."""
    bf16 = capability >= (8, 0)
    return PlatformCaps(
        dtypes=("bfloat16", "float16", "float32") if bf16 else ("float16", "float32"),
        default_dtype="bfloat16" if bf16 else "float16",
        pinned_memory=True,
        async_output=True,
        sampling_draw="exponential_race",
        profiles_memory=True,
        batch_invariance=True,
    )


class CUDAPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    # ROCm's torch honours it too (and inherits it): HIP_VISIBLE_DEVICES would stack on a
    # CUDA_VISIBLE_DEVICES the server was started with instead of replacing it.
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

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
        return self.planned_capabilities(_device_capability())

    def planned_capabilities(self, compute_capability: tuple[int, int]) -> PlatformCaps:
        # FP8 tensor cores (torch._scaled_mm) from Ada/Hopper (8.9) on; the Triton 4- and 8-bit GEMMs
        # (block-scaled FP8 weights widened in the GEMM among them) and MXFP4 experts' fused MoE anywhere.
        kernels = (("fp8_scaled_mm",) if compute_capability >= (8, 9) else ()) + ("w4a16", "w8a16", "fp8_block_w8a16",
                                                                                  "mxfp4_moe")
        return dataclasses.replace(gpu_caps(compute_capability), quantization_kernels=kernels)

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name(0)

    def device_memory(self) -> int:
        import torch

        return torch.cuda.mem_get_info()[1]  # the total the worker sizes the KV cache against

    def distributed_backend(self) -> str:
        return "nccl"  # ROCm's torch maps it to RCCL

    def device_communicator(self, tp):
        from .custom_allreduce import create_communicator

        return create_communicator(tp)  # None on ROCm and without peer access: NCCL for every size

    def ray_resources_per_rank(self) -> dict[str, float]:
        return {"GPU": 1.0}

    def check_config(self, config) -> None:
        import torch
        from corectl.errors import ConfigError

        from .batch_invariant import check_invariant_config

        check_invariant_config(config)
        # Ray places each rank on a GPU of the cluster; this host's count matters to "mp" only.
        ranks = config.world_size
        if config.distributed_executor_backend != "ray" and ranks > torch.cuda.device_count():
            raise ConfigError("tensor_parallel_size", f"{ranks} ranks (tensor x pipeline parallel) need {ranks} GPUs; "
                              f"this host has {torch.cuda.device_count()} (use the ray backend to span machines)")

    def worker_cls(self):
        from .worker import CUDAWorker

        return CUDAWorker

    def default_attention_backend(self, model_config) -> str:
        return "triton"
