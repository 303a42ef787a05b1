"""Adapters on mixture-of-experts experts: the two checkpoint layouts, read into one form.

- Parameter LoRA (PEFT `target_parameters` over transformers 5's fused experts, whose
  `mlp.experts.gate_up_proj` is [E, 2I, H] and `down_proj` [E, H, I]): one pair per stacked
  parameter, `<layer>.mlp.experts.lora_A.weight` [E * r, in] and `lora_B.weight` [out, E * r].
  PEFT's ParamWrapper views A as [E, r, in] and B as [out, r, E]: expert e's A is rows
  [e * r, (e + 1) * r), its B the columns e, e + E, e + 2E, ... The wrapper of a second
  parameter wraps the first, which PEFT then names `experts.base_layer.lora_A`; PEFT keeps
  `target_parameters` as a set, so which name holds which parameter is not fixed: a pair is told
  apart by its shape (gate_up: in H, out 2I; down: in I, out H; never both). PEFT before 0.19.1
  read a stack [E, out, in] as [E, in, out] (its A over the stack's out features, its delta the
  transpose of B A): such a pair (gate_up: "in" 2I, "out" H; down: "in" H, "out" I) is read
  transposed, A_e = B_e.T and B_e = A_e.T. Where the widths cannot tell (H = 2I or H = I) the
  current layout is assumed.
- Per-expert modules (transformers 4's experts, the layout vLLM loads):
  `<layer>.mlp.experts.<e>.gate_proj|up_proj|down_proj`, Mixtral's
  `<layer>.block_sparse_moe.experts.<e>.w1|w3|w2`, each A [r, in] and B [out, r].

The one form (`LoRAAdapter.weights`): `<layer>.mlp.experts.gate_up_proj` -> (A [E, 2, r, H]:
gate's A then up's, which parameter LoRA shares; B [E, 2I, r]: gate rows then up rows) and
`<layer>.mlp.experts.down_proj` -> (A [E, 1, r, I], B [E, H, r]). An expert or projection the
checkpoint leaves out is zero.
"""
from __future__ import annotations

import re

import torch

from .errors import LoRAAdapterError
from .request import LoRARequest
from .shapes import BaseModelShape, ExpertShape

Pair = tuple[torch.Tensor, torch.Tensor]

_FUSED = re.compile(r"^(?P<layer>model\.layers\.(?P<index>\d+))\.mlp\.experts(?:\.base_layer)*$")
_PER_EXPERT = re.compile(r"^(?P<layer>model\.layers\.(?P<index>\d+))\.(?:mlp|block_sparse_moe)\.experts\."
                         r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_ROUTER = re.compile(r"(?:^|\.)(?:mlp|block_sparse_moe)\.gate$|^gate$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Names `target_modules` / `target_parameters` may give for experts.
EXPERT_MODULES = ("w1", "w2", "w3")
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def refuse_router(lora: LoRARequest, name: str) -> None:
    """A mixture-of-experts router (`mlp.gate`) is never adapted: say so by name."""
    if _ROUTER.search(name.removesuffix(".weight")):
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets {name!r}, a mixture-of-experts router: corectl "
                               "adapts experts and projections, not routers")


def check_target_parameters(lora: LoRARequest, names) -> None:
    """PEFT's `target_parameters`: only the experts' stacked gate_up_proj and down_proj."""
    for name in names or []:
        refuse_router(lora, name)
        if name.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS or not (name.startswith("experts.") or ".experts." in name
                                                                   or "." not in name):
            raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets parameter {name!r}, which corectl cannot "
                                   "adapt; supported target parameters: mlp.experts.gate_up_proj, "
                                   "mlp.experts.down_proj")


def is_expert_module(module: str) -> bool:
    return bool(_FUSED.match(module) or _PER_EXPERT.match(module))


def expert_weights(lora: LoRARequest, pairs: dict[str, Pair], base: BaseModelShape) -> tuple[dict[str, Pair], int]:
    """The expert pairs of `pairs` (checkpoint modules) in the one form, and their largest rank."""
    fused: dict[str, list[tuple[str, Pair]]] = {}
    per_expert: dict[str, dict[tuple[str, int], tuple[str, Pair]]] = {}
    for module, pair in pairs.items():
        match = _FUSED.match(module) or _PER_EXPERT.match(module)
        shape = _experts_of(lora, module, int(match["index"]), base)
        if "expert" in match.groupdict():
            proj = _MIXTRAL_NAMES.get(match["proj"], match["proj"])
            per_expert.setdefault(match["layer"], {})[(proj, int(match["expert"]))] = (module, pair)
            _check_per_expert(lora, module, proj, int(match["expert"]), pair, shape)
        else:
            fused.setdefault(match["layer"], []).append((module, pair))
    both = set(fused) & set(per_expert)
    if both:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} adapts the experts of {sorted(both)[0]!r} twice: as "
                               "stacked parameters and as per-expert modules")
    out: dict[str, Pair] = {}
    for layer, entries in fused.items():
        out.update(_from_fused(lora, layer, entries, base.experts))
    for layer, entries in per_expert.items():
        out.update(_from_per_expert(layer, entries, base.experts))
    return out, max((a.shape[2] for a, _ in out.values()), default=0)


def _experts_of(lora: LoRARequest, module: str, layer: int, base: BaseModelShape) -> ExpertShape:
    if base.experts is None:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets module {module!r}, mixture-of-experts experts, "
                               "which the base model has none of that corectl adapts (experts take adapters on "
                               "Qwen3-MoE and Mixtral)")
    if layer >= base.num_layers:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets module {module!r}, past the base model's "
                               f"{base.num_layers} layers")
    return base.experts


def _float(lora: LoRARequest, name: str, pair: Pair) -> None:
    if not (pair[0].is_floating_point() and pair[1].is_floating_point()):
        raise LoRAAdapterError(f"adapter {lora.lora_name!r}: {name} has {pair[0].dtype} weights")


def _check_per_expert(lora: LoRARequest, module: str, proj: str, expert: int, pair: Pair, shape: ExpertShape) -> None:
    a, b = pair
    _float(lora, module, pair)
    if expert >= shape.num_experts:
        raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets module {module!r}: the base model has "
                               f"{shape.num_experts} experts a layer")
    r = a.shape[0] if a.dim() == 2 else 0
    features = (shape.intermediate, shape.hidden) if proj == "down_proj" else (shape.hidden, shape.intermediate)
    expected_a, expected_b = (r, features[0]), (features[1], r)
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise LoRAAdapterError(
            f"adapter {lora.lora_name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
            f"the base model's expert {proj} needs {expected_a} and {expected_b}: was it trained on another base "
            "model?")


def _from_fused(lora: LoRARequest, layer: str, entries: list[tuple[str, Pair]], shape: ExpertShape) -> dict[str, Pair]:
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    out: dict[str, Pair] = {}
    for module, (a, b) in entries:
        _float(lora, module, (a, b))
        rows = a.shape[0] if a.dim() == 2 else -1
        fits = a.dim() == 2 and b.dim() == 2 and rows > 0 and rows % e == 0 and b.shape[1] == rows
        # Later entries win where widths coincide: the current layout over the pre-0.19.1 one.
        layouts = {(2 * i, h): ("gate_up_proj", True), (h, i): ("down_proj", True),
                   (h, 2 * i): ("gate_up_proj", False), (i, h): ("down_proj", False)}
        proj, transposed = layouts.get((a.shape[-1], b.shape[0]), (None, False)) if fits else (None, False)
        if proj is None:
            raise LoRAAdapterError(
                f"adapter {lora.lora_name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, which "
                f"fit neither stacked expert parameter of the base model ({e} experts, rank r): gate_up_proj needs "
                f"[{e} * r, {h}] and [{2 * i}, {e} * r], down_proj [{e} * r, {i}] and [{h}, {e} * r]: was it trained "
                "on another base model?")
        key = f"{layer}.mlp.experts.{proj}"
        if key in out:
            raise LoRAAdapterError(f"adapter {lora.lora_name!r} holds two pairs for {key!r}")
        r = rows // e
        a_experts = a.reshape(e, r, a.shape[1])
        b_experts = b.reshape(b.shape[0], r, e).permute(2, 0, 1)
        if transposed:
            a_experts, b_experts = b_experts.transpose(1, 2), a_experts.transpose(1, 2)
        a_experts = a_experts.unsqueeze(1)
        out[key] = (a_experts.expand(e, 2, r, h) if proj == "gate_up_proj" else a_experts, b_experts)
    return out


def _from_per_expert(layer: str, entries: dict[tuple[str, int], tuple[str, Pair]], shape: ExpertShape
                     ) -> dict[str, Pair]:
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    r = max(pair[0].shape[0] for _, pair in entries.values())
    dtype = next(iter(entries.values()))[1][0].dtype
    out: dict[str, Pair] = {}
    if any(proj != "down_proj" for proj, _ in entries):
        out[f"{layer}.mlp.experts.gate_up_proj"] = (torch.zeros(e, 2, r, h, dtype=dtype),
                                                    torch.zeros(e, 2 * i, r, dtype=dtype))
    if any(proj == "down_proj" for proj, _ in entries):
        out[f"{layer}.mlp.experts.down_proj"] = (torch.zeros(e, 1, r, i, dtype=dtype),
                                                 torch.zeros(e, h, r, dtype=dtype))
    for (proj, expert), (_, (a, b)) in entries.items():
        rank = a.shape[0]
        stack_a, stack_b = out[f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
        j = 1 if proj == "up_proj" else 0
        stack_a[expert, j, :rank] = a
        stack_b[expert, j * i:j * i + b.shape[0], :rank] = b
    return out
