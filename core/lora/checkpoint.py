"""Reading a PEFT LoRA checkpoint into per-projection A/B matrices, checked against the base model.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, target modules)
and `adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] per adapted projection. PEFT adds `(x @ A.T @ B.T) * scaling` to the
base projection's output, `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA); so does
the engine. Everything the engine cannot apply exactly (DoRA, LoRA on embeddings or the LM head,
LoRA biases, extra trained modules, per-module rank patterns) is refused with the module named:
serving such an adapter without it would silently give other outputs than the adapter's.
Mixture-of-experts experts (Qwen3-MoE, Mixtral) take adapters in either of their checkpoint
layouts (`expert_checkpoint`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import LORA_RANKS
from .errors import LoRAAdapterError
from .expert_checkpoint import (EXPERT_MODULES, check_target_parameters, expert_weights, is_expert_module,
                                refuse_router)
from .request import CONFIG_FILE, LoRARequest
from .shapes import BaseModelShape

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# The projections an adapter may target, by their checkpoint names.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
# The modules an adapter may adapt: a decoder layer's attention and dense MLP projections.
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)$")


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter on the host: `weights` maps a module path (`model.layers.0.self_attn.q_proj`)
    to its (A [r, in], B [out, r]) in the checkpoint's dtype, and an expert stack
    (`model.layers.0.mlp.experts.gate_up_proj`) to its per-expert form (`expert_checkpoint`);
    `scaling` multiplies every B product."""

    name: str
    int_id: int
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def adapter_folder(lora: LoRARequest, cache_dir: str | None = None) -> Path:
    """The local folder of `lora.lora_path`: the path itself, or a hub snapshot of its adapter files."""
    path = Path(lora.lora_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {lora.lora_path} is a file; lora_path names the "
                               f"folder holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    from ..loaders.hub import download_adapter

    try:
        return download_adapter(lora.lora_path, cache_dir)
    except Exception as exc:  # the hub's errors name the repo; ours adds which adapter asked
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {lora.lora_path} is not a local folder, and it could "
                               f"not be fetched as a hub id: {exc}", code="model_not_found") from exc


def load_adapter(lora: LoRARequest, base: BaseModelShape, cache_dir: str | None = None) -> LoRAAdapter:
    """Read and check `lora`'s PEFT checkpoint; raises LoRAAdapterError naming what is wrong."""
    folder = adapter_folder(lora, cache_dir)
    config = _read_config(lora, folder)
    pairs = _pair_tensors(lora, _read_tensors(lora, folder))
    experts, expert_rank = expert_weights(lora, {m: p for m, p in pairs.items() if is_expert_module(m)}, base)
    weights = {m: p for m, p in pairs.items() if not is_expert_module(m)}
    _check_module_names(lora, weights)
    rank = config["r"]
    _check_rank(lora, rank, base)
    _check_shapes(lora, weights, base, rank)
    if experts and expert_rank != rank:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: its expert weights have rank {expert_rank}, its "
                               f"{CONFIG_FILE} says r {rank}")
    weights.update(experts)
    scaling = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return LoRAAdapter(lora.lora_name, lora.lora_int_id, rank, float(scaling), weights)


def _read_config(lora: LoRARequest, folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {folder} has no {CONFIG_FILE}; a PEFT LoRA "
                               "checkpoint (model.save_pretrained) holds it beside its weights")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {path} is not valid JSON: {exc}") from exc
    peft_type = str(config.get("peft_type", "LORA")).upper()
    problems = {
        f"peft_type {peft_type} (only LoRA adapters are served)": peft_type != "LORA",
        "DoRA (use_dora: true), whose magnitude vectors change the base weights": config.get("use_dora"),
        f"LoRA biases (bias: {config.get('bias')!r})": config.get("bias", "none") not in (None, "none"),
        f"fully trained modules_to_save {config.get('modules_to_save')}": config.get("modules_to_save"),
        "per-module ranks or alphas (rank_pattern / alpha_pattern)": config.get("rank_pattern") or config.get(
            "alpha_pattern"),
        "fan_in_fan_out weights (GPT-2 Conv1D layouts)": config.get("fan_in_fan_out"),
    }
    for problem, present in problems.items():
        if present:
            raise LoRAAdapterError(f"adapter {lora.lora_name!r} uses {problem}, which corectl does not serve")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        _check_module_names(lora, targets)
    check_target_parameters(lora, config.get("target_parameters"))
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {CONFIG_FILE} has no positive integer rank r "
                               f"(got {rank!r})")
    return config


def _check_module_names(lora: LoRARequest, names) -> None:
    for name in names:
        refuse_router(lora, name)
        if name.rsplit(".", 1)[-1] not in SUPPORTED_MODULES + EXPERT_MODULES:
            raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets module {name!r}, which corectl cannot adapt; "
                                   f"supported target modules: {', '.join(SUPPORTED_MODULES)} (and Mixtral's "
                                   f"experts' {', '.join(EXPERT_MODULES)})")


def _read_tensors(lora: LoRARequest, folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        if (folder / PICKLE_FILE).is_file():
            raise LoRAAdapterError(
                f"adapter {lora.lora_name!r}: {folder} holds {PICKLE_FILE}, a pickle checkpoint, which corectl does "
                f"not load (unpickling can run code); save it as {WEIGHTS_FILE} "
                "(PeftModel.save_pretrained(..., safe_serialization=True))")
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {folder} has no {WEIGHTS_FILE}")
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for every kind of damage
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {path} is not a readable safetensors file "
                               f"(corrupt or truncated): {exc}") from exc


def _pair_tensors(lora: LoRARequest, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            module = key.removeprefix("base_model.model.").rsplit(".", 1)[0]
            what = "a DoRA magnitude vector" if "magnitude" in key else f"tensor {key!r}"
            raise LoRAAdapterError(f"adapter {lora.lora_name!r} holds {what} for module {module!r}, which corectl "
                                   "does not serve (only lora_A/lora_B weights of "
                                   f"{', '.join(SUPPORTED_MODULES)})")
        halves.setdefault(match["module"], {})[match["kind"]] = tensor
    if not halves:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} holds no lora_A/lora_B weights")
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(half)).pop()
            raise LoRAAdapterError(f"adapter {lora.lora_name!r}: module {module!r} has no {missing} weight")
        pairs[module] = (half["lora_A"], half["lora_B"])
    return pairs


def _check_shapes(lora: LoRARequest, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], base: BaseModelShape,
                  rank: int) -> None:
    """Every pair against the base projection it adapts and the config's rank (one rank for all: per-module
    ranks are refused with the config, and a scaling of lora_alpha over another rank would be wrong)."""
    for module, (a, b) in weights.items():
        path = _MODULE.match(module)
        if path is None or int(path["layer"]) >= base.num_layers:
            raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets module {module!r}, which is not an attention "
                                   f"or dense MLP projection of the base model's {base.num_layers} layers")
        shape = base.projections[module.rsplit(".", 1)[-1]]
        if a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[1] != rank:
            raise LoRAAdapterError(f"adapter {lora.lora_name!r}: module {module!r} has rank {a.shape[0]}, its "
                                   f"{CONFIG_FILE} says r {rank}")
        expected_a, expected_b = (rank, shape.in_features), (shape.out_features, rank)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise LoRAAdapterError(
                f"adapter {lora.lora_name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, the base model's projection needs {expected_a} and {expected_b} (in "
                f"{shape.in_features}, out {shape.out_features} features): was it trained on another base model?")
        if not a.is_floating_point():
            raise LoRAAdapterError(f"adapter {lora.lora_name!r}: module {module!r} has {a.dtype} weights")


def _check_rank(lora: LoRARequest, rank: int, base: BaseModelShape) -> None:
    if rank > base.max_lora_rank:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} has rank {rank}, above max_lora_rank "
                               f"{base.max_lora_rank}; start the engine with a larger --max-lora-rank "
                               f"({', '.join(map(str, LORA_RANKS))})")
