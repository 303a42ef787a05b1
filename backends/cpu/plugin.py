"""Registers the CPU platform and its attention backend (entry point `cpu`)."""
from corectl.plugins import AttentionBackendSpec, PlatformSpec, hookimpl


@hookimpl
def corectl_platforms():
    yield PlatformSpec("cpu", "corectl.backends.cpu.platform:CPUPlatform", priority=0,
                       description="x86-64/Arm CPUs through torch (fp32, bf16)")


@hookimpl
def corectl_attention_backends():
    yield AttentionBackendSpec("torch_sdpa", "corectl.backends.cpu.attention:TorchSDPABackend",
                               platforms=("cpu",))
