"""`cpu_reference`: corectl's CPU worker in fp32 with the eager reference attention backend.

It exists to check other backends and models against: every step runs in fp32 and attention is
computed the way `transformers`' eager path computes it, one sequence at a time. It is slow by
design, so its plugin priority sits below the built-in CPU platform and `auto` never chooses it.
"""
from __future__ import annotations

from corectl.backends.cpu.platform import CPUPlatform
from corectl.platform import PlatformCaps

from .plugin import ATTENTION_BACKEND, PLATFORM


class ReferenceCPUPlatform(CPUPlatform):
    """corectl's CPU platform (detection, worker) with its own name, dtype and attention backend."""

    name = PLATFORM

    def capabilities(self) -> PlatformCaps:
        return PlatformCaps(
            dtypes=("float32",),
            default_dtype="float32",
            sampling_draw="inverse_cdf",
        )

    def default_attention_backend(self, model_config) -> str:
        return ATTENTION_BACKEND
