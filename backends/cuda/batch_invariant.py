"""What `--batch-invariant` takes on CUDA and ROCm, and what it refuses (docs/performance.md,
"Batch-invariant output").

The mode swaps in kernels whose launch depends on the layer's shape only (the invariant GEMM for
every dense linear and the LM head, the prefill attention kernel with model-fixed tiles for every
step). Anything whose arithmetic still depends on the batch is refused at start-up with one line
naming the flag and the feature, rather than served with a promise it does not keep.
"""
from __future__ import annotations

import torch
from corectl.envs import fused_kernels_enabled
from corectl.errors import ConfigError
from corectl.models.kernels import UsesLayerKernels
from corectl.models.mla import MLAttention
from corectl.models.moe import FusedMoE

_FLAG = "--batch-invariant"


def _refuse(field: str, feature: str, remedy: str) -> ConfigError:
    return ConfigError(field, f"{_FLAG} has no batch-invariant kernels for {feature}; {remedy}")


def check_invariant_config(config) -> None:
    """The options whose work depends on the batch, refused before anything loads."""
    if not config.batch_invariant:
        return
    if config.enable_lora:
        raise _refuse("enable_lora", "LoRA adapters (the punica kernels split work by the batch's adapters)",
                      "drop --enable-lora or --batch-invariant")
    if config.tensor_parallel_size > 1:
        raise _refuse("tensor_parallel_size", "tensor parallelism (the all-reduce picks its algorithm by message "
                      "size, which grows with the batch)", "use --tensor-parallel-size 1 or drop the flag")
    if config.speculative_config is not None:
        raise _refuse("speculative_config", "speculative decoding (verify steps run other graphs than decode "
                      "steps)", "drop --speculative-config or --batch-invariant")
    if not fused_kernels_enabled():
        raise ConfigError("batch_invariant", f"{_FLAG} runs on the fused kernels, which CORECTL_FUSED_KERNELS=0 "
                          "turns off (torch's GEMMs choose their algorithm by the batch); unset it or drop the flag")


def check_invariant_quantization(quantization) -> None:
    """Quantized weights, asked for (`--quantization fp8`) or the checkpoint's own (FP8, AWQ, GPTQ, a
    4-bit GGUF kept packed), as resolved before the weights load."""
    if quantization is not None:
        raise _refuse("quantization", f"{quantization.name!r} quantized weights (their GEMMs choose tiles and "
                      "split-K by the batch)", "load dense bf16/fp16 weights (--quantization none) or drop the flag")


def check_invariant_model(model: torch.nn.Module) -> None:
    """Refuse a model with a layer whose GEMM bypasses `LayerKernels.dense_linear`: experts,
    latent attention's per-head products, and plain nn.Linear layers (routers, vision towers,
    encoders), which run cuBLAS directly."""
    modules = list(model.named_modules())
    bypasses = (
        (lambda m: isinstance(m, FusedMoE), "mixture-of-experts layers ({})"),
        (lambda m: isinstance(m, MLAttention), "multi-head latent attention ({})"),
        # After the two above, whose routers and projections are such layers too.
        (lambda m: isinstance(m, torch.nn.Linear) and not isinstance(m, UsesLayerKernels),
         f"{type(model).__name__}'s {{}} (an nn.Linear outside the fused layers)"),
    )
    for bypasses_kernels, feature in bypasses:
        name = next((n for n, m in modules if bypasses_kernels(m)), None)
        if name is not None:
            raise _refuse("batch_invariant", feature.format(name), "serve a dense decoder-only model or drop the flag")


def make_runner_invariant(runner) -> None:
    """After the model is built with the invariant layer kernels: refuse what bypasses them, and
    switch the attention backend to its batch-invariant launches (refused where it has none)."""
    check_invariant_model(runner.model)
    make_attention_invariant(runner.backend)


def make_attention_invariant(backend) -> None:
    if not hasattr(backend, "batch_invariant"):
        raise _refuse("attention_backend", f"the {backend.name!r} attention backend",
                      "use --attention-backend triton or drop the flag")
    backend.batch_invariant = True
