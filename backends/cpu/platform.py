"""CPU platform: always available. A bf16 checkpoint computes in bf16 and anything else (fp32 or
quantized, the embedded GGUF among them) in fp32: in bf16 the embedded SmolLM2 flips a near-tie
first token ("L'Étoile..." instead of "Paris" on AVX512-BF16/AMX CPUs), and its 4-bit GEMMs
(corectl.quantization.int4_cpu) take fp32 activations, so fp32 around them costs no casts."""
from __future__ import annotations

import logging
import os

from corectl.platform import Platform, PlatformCaps


logger = logging.getLogger("corectl.cpu")


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
            default_dtype="float32",
            sampling_draw="inverse_cdf",
            quantization_kernels=("cpu_int4pack",),
            rank_start_method="forkserver",
            batch_invariance=True,
        )

    def check_config(self, config) -> None:
        if config.batch_invariant:
            # tests/backends/cpu/test_batch_invariance.py holds the CPU kernels to it in every mode.
            logger.info("--batch-invariant: the CPU kernels compute each row alone already (row-invariant GEMMs, "
                        "attention per sequence); nothing changes")

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
