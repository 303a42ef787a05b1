"""ModelSource: a resolved checkpoint, and filling a model's parameters from it."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from ..errors import ConfigError
from .checkpoint_files import count_tensors, iter_safetensors

DUMMY_STD = 0.02
MAX_LISTED = 20


@dataclass(frozen=True)
class ModelSource:
    """What the engine needs to build and fill a model.

    hf_config: the checkpoint's config with `EngineConfig.hf_overrides` applied.
    model_dir: HF-style folder with config.json (for GGUF, the converted cache folder).
    tokenizer_dir: folder with the tokenizer files (model_dir unless `EngineConfig.tokenizer` names another);
        None when the engine runs without a tokenizer (`EngineConfig.skip_tokenizer_init`).
    description: where the weights come from, for logs.
    model_dtype: the checkpoint's dtype name ("float32"/"bfloat16"/"float16"), None when it does not say.
    weight_files: the safetensors files to stream; empty when `dummy_seed` is set.
    dummy_seed: random weights from this seed instead of files (load_format "dummy").
    gguf_file: the GGUF file the checkpoint was converted from (a quantization config may read its
        blocks instead of the converted weights), None for other checkpoints.
    """

    hf_config: PretrainedConfig
    model_dir: Path
    tokenizer_dir: Path | None
    description: str
    model_dtype: str | None
    weight_files: tuple[Path, ...] = ()
    dummy_seed: int | None = None
    gguf_file: Path | None = None

    def load_weights(self, model: nn.Module, quantization=None,
                     rename: Callable[[Iterable], Iterable] | None = None) -> None:
        """Fill every parameter of `model`; raise naming the parameters the checkpoint left empty.
        A `quantization` config may stream the weights itself (GGUF's blocks from `gguf_file`);
        `rename` maps the stream of (name, tensor) pairs first (a pooling model drops the LM head)."""
        if self.dummy_seed is not None:
            fill_dummy_weights(model, self.dummy_seed)
            return
        own = None if quantization is None else quantization.weight_stream(self)
        stream = tqdm(
            iter_safetensors(self.weight_files) if own is None else own,
            total=count_tensors(self.weight_files) if own is None else None,
            desc="loading weights",
            unit="tensor",
            disable=not sys.stderr.isatty(),
        )
        with torch.no_grad():
            filled = model.load_weights(stream if rename is None else rename(stream))
        missing = sorted({name for name, _ in model.named_parameters()} - set(filled))
        if missing:
            listed = ", ".join(missing[:MAX_LISTED]) + (" ..." if len(missing) > MAX_LISTED else "")
            raise ConfigError(
                "model",
                f"checkpoint {self.description} has no weights for {len(missing)} parameters of "
                f"{type(model).__name__}: {listed}; the checkpoint is incomplete or made for another architecture",
            )


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in place, the same for a given seed: normal(0, 0.02) matrices, unit norm weights,
    zero biases. Values are drawn on each parameter's own device, so large models need no host copy."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        elif not param.is_floating_point():
            # Packed integer weights (4-bit codes in int32 words): any bit pattern is a valid value.
            param.random_(0, 2 ** min(31, 8 * param.element_size() - 1), generator=_generator(generators, param, seed))
        else:
            param.normal_(0.0, DUMMY_STD, generator=_generator(generators, param, seed))


def _generator(generators: dict[torch.device, torch.Generator], param: torch.Tensor, seed: int) -> torch.Generator:
    if param.device not in generators:
        generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
    return generators[param.device]
