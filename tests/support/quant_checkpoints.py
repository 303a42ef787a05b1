"""Quantized checkpoints written the way their tools write them (AWQ's GEMM packing, AutoGPTQ's
layout with act-order, compressed-tensors and `fp8` FP8), from a dense random-weight model, plus
the dense model of the dequantized weights they encode: the reference they must match."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from corectl import LLM, SamplingParams
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 16
# A divergence is a near-tie when the reference's top two tokens there are this close (logprobs):
# bf16 activations (the packed int4 GEMM's) move SmolLM2's logits by up to ~0.1.
NEAR_TIE = 0.1


def pack_nibbles(codes: np.ndarray, order: list[int]) -> torch.Tensor:
    """Eight 4-bit codes per int32 along the last axis, nibble i holding element order[i]."""
    grouped = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, 8)[..., order]
    words = (grouped << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return torch.from_numpy(words.view(np.int32).copy())


def quantize_int4(w: torch.Tensor, g_idx: np.ndarray, groups: int):
    """Asymmetric 4-bit codes [N, K], zeros and scales [groups, N] per group of inputs g_idx names."""
    w = w.double().numpy()
    n, k = w.shape
    scales, zeros, codes = np.zeros((groups, n)), np.zeros((groups, n), np.int64), np.zeros((n, k), np.int64)
    for g in range(groups):
        cols = g_idx == g
        lo, hi = np.minimum(w[:, cols].min(1), 0), np.maximum(w[:, cols].max(1), 0)
        scale = (hi - lo).clip(1e-6) / 15
        zero = np.clip(np.round(-lo / scale), 1, 15)  # >= 1: GPTQ stores zero - 1 in 4 bits
        codes[:, cols] = np.clip(np.round(w[:, cols] / scale[:, None]) + zero[:, None], 0, 15)
        scales[g], zeros[g] = scale.astype(np.float16), zero
    dequant = (codes - zeros[g_idx].T) * scales[g_idx].T
    return codes, zeros, scales.astype(np.float16), torch.from_numpy(dequant).float()


def _input_seed(name: str) -> int:
    layer = int(name.split(".")[2])
    shared = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
    return 4 * layer + shared[name.split(".")[-2]]


def write_w4_checkpoints(dense: Path, out: Path, method: str, group: int, act_order: bool = False):
    """(quantized folder, dequantized dense folder) for `method` "awq" or "gptq"."""
    tensors, quantized, reference = load_file(dense / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        proj = name.split(".")[-2]
        if proj not in LINEAR:
            quantized[name] = reference[name] = w
            continue
        k = w.shape[1]
        g_idx = np.arange(k) // group
        if act_order:
            # GPTQ orders inputs by the Hessian of the layer's input: q/k/v (and gate/up) share one order.
            g_idx = g_idx[np.random.default_rng(_input_seed(name)).permutation(k)]
        codes, zeros, scales, reference[name] = quantize_int4(w, g_idx, k // group)
        stem = name.removesuffix(".weight")
        quantized[f"{stem}.scales"] = torch.from_numpy(scales)
        if method == "awq":
            quantized[f"{stem}.qweight"] = pack_nibbles(codes.T, AWQ_ORDER)
            quantized[f"{stem}.qzeros"] = pack_nibbles(zeros, AWQ_ORDER)
        else:
            # AutoGPTQ: row r of qweight packs inputs 8r .. 8r+7 of each output column, in order.
            by_input = codes.T.reshape(k // 8, 8, -1).transpose(0, 2, 1).reshape(k // 8, -1)
            quantized[f"{stem}.qweight"] = pack_nibbles(by_input, list(range(8)))
            quantized[f"{stem}.qzeros"] = pack_nibbles(zeros - 1, list(range(8)))
            quantized[f"{stem}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    config = {"quant_method": method, "bits": 4, "group_size": group}
    config.update({"zero_point": True, "version": "gemm"} if method == "awq" else {"desc_act": act_order, "sym": False})
    return _save(dense, out / method, quantized, config), _save(dense, out / f"{method}-reference", reference, None)


def write_fp8_checkpoints(dense: Path, out: Path, method: str, per_channel: bool, static_inputs: bool = False,
                          drop: tuple[str, ...] = (), ignore: tuple[str, ...] = ()):
    """(e4m3 checkpoint with `weight_scale`s, dequantized dense folder); `drop` leaves tensors out;
    layers whose names contain an `ignore` entry stay dense (listed in the config as not quantized)."""
    tensors, quantized, reference = load_file(dense / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        if name.split(".")[-2] not in LINEAR or any(part in name for part in ignore):
            quantized[name] = reference[name] = w
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = (amax / 448.0).float()
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        stem = name.removesuffix(".weight")
        quantized[name], quantized[f"{stem}.weight_scale"] = q, scale.reshape(-1, 1) if per_channel else scale
        if static_inputs:
            quantized[f"{stem}.input_scale"] = torch.tensor(0.05)
        reference[name] = q.float() * scale
    for name in drop:
        del quantized[name]
    if method == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "static" if static_inputs else "dynamic",
                  "ignored_layers": list(ignore)}
    else:
        scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor",
                              "symmetric": True, "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": not static_inputs},
                  "targets": ["Linear"]}
        config = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": scheme}, "ignore": ["lm_head", *ignore]}
    return _save(dense, out / method, quantized, config), _save(dense, out / f"{method}-reference", reference, None)


def _save(dense: Path, folder: Path, tensors: dict, quant_config: dict | None) -> Path:
    shutil.copytree(dense, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_prompts(count: int = 8, vocab: int = 49152) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(100, vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(4, 40, (count,), generator=generator)]


def greedy_divergences(ours: LLM, reference: LLM, prompts) -> list[tuple[int, int, float]]:
    """Compare greedy tokens; returns (prompt, position, reference's top-2 logprob gap) of each
    prompt whose tokens differ, and asserts each such divergence is a near-tie of the reference."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    got = ours.generate(prompts, params, use_tqdm=False)
    expected = reference.generate(prompts, params, use_tqdm=False)
    divergences = []
    for i, (a, b) in enumerate(zip(got, expected)):
        ta, tb = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        if ta == tb:
            continue
        pos = next(j for j, (x, y) in enumerate(zip(ta, tb)) if x != y)
        top = sorted((lp.logprob for lp in b.outputs[0].logprobs[pos].values()), reverse=True)
        divergences.append((i, pos, top[0] - top[1]))
    assert all(gap < NEAR_TIE for _, _, gap in divergences), f"divergences that are not near-ties: {divergences}"
    return divergences


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek V3's block FP8: (e4m3 [N, K], fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)],
    the dequantized fp32 [N, K]), each block's max mapped to 448 (the last blocks may be partial)."""
    (n, k), (bn, bk) = w.shape, block
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (q.float() * scale[:, None, :, None]).view_as(padded)[:n, :k]
    return q.view_as(padded)[:n, :k].contiguous(), scale, dequantized


def write_block_fp8_checkpoints(dense: Path, out: Path, block: tuple[int, int], projections: tuple[str, ...],
                                ignore: tuple[str, ...] = ()):
    """(block-FP8 checkpoint as DeepSeek V3 ships it: `weight` e4m3 and `weight_scale_inv` of every
    linear named in `projections`, dequantized dense folder); layers whose names contain an
    `ignore` entry stay dense (the config's `modules_to_not_convert`)."""
    tensors, quantized, reference = load_file(dense / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        if name.split(".")[-2] not in projections or any(part in name for part in ignore):
            quantized[name] = reference[name] = w
            continue
        q, scale, reference[name] = block_quantize(w, block)
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block), "modules_to_not_convert": list(ignore)}
    return _save(dense, out / "block-fp8", quantized, config), _save(dense, out / "block-fp8-reference", reference, None)
