"""Registers the ROCm platform (entry point `rocm`); its attention backend is the shared `triton` one."""
from corectl.plugins import PlatformSpec, hookimpl


@hookimpl
def corectl_platforms():
    yield PlatformSpec("rocm", "corectl.backends.rocm.platform:ROCmPlatform", priority=90,
                       description="AMD GPUs through torch's HIP build (Triton kernels)")
