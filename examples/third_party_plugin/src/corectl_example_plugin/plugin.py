"""The hook implementations corectl finds through the `corectl` entry point of this package."""
from corectl.plugins import AttentionBackendSpec, ModelSpec, PlatformSpec, QuantizationMethodSpec, hookimpl

PLATFORM = "cpu_reference"
ATTENTION_BACKEND = "torch_eager"


@hookimpl
def corectl_model_architectures():
    yield ModelSpec("GemmaForCausalLM", "corectl_example_plugin.gemma:GemmaForCausalLM")


@hookimpl
def corectl_platforms():
    # Below the built-in CPU (priority 0) so `platform="auto"` never picks it: it is chosen by name.
    yield PlatformSpec(PLATFORM, "corectl_example_plugin.platform:ReferenceCPUPlatform", priority=-10,
                       description="fp32 CPU with eager per-sequence attention, a numerical reference")


@hookimpl
def corectl_attention_backends():
    # Also allowed on the stock CPU platform, to check its SDPA backend against this reference.
    yield AttentionBackendSpec(ATTENTION_BACKEND, "corectl_example_plugin.attention:EagerReferenceBackend",
                               platforms=(PLATFORM, "cpu"))


@hookimpl
def corectl_quantization_methods():
    yield QuantizationMethodSpec("rtn_int4", "corectl_example_plugin.quantization:RTNInt4Config",
                                 "4-bit round-to-nearest groups of 32, made at load time")
