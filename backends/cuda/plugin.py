"""Registers the CUDA platform and the Triton attention backend (entry point `cuda`)."""
from corectl.plugins import AttentionBackendSpec, PlatformSpec, hookimpl


@hookimpl
def corectl_platforms():
    yield PlatformSpec("cuda", "corectl.backends.cuda.platform:CUDAPlatform", priority=100,
                       description="NVIDIA GPUs (Triton kernels, CUDA graphs)")


@hookimpl
def corectl_attention_backends():
    yield AttentionBackendSpec("triton", "corectl.backends.triton.attention.backend:TritonAttentionBackend",
                               platforms=("cuda", "rocm"))
