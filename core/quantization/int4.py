"""AWQ and GPTQ 4-bit weight-only checkpoints (W4A16, groups of `group_size` inputs).

Both store unsigned 4-bit codes with a per-group scale and zero point, w = (q - z) * s, packed
eight to an int32:
  - AWQ: qweight [K, N/8] packed along the outputs in the order 0 2 4 6 1 3 5 7; qzeros
    [K/G, N/8] likewise; scales [K/G, N].
  - GPTQ (AutoGPTQ's format): qweight [K/8, N] packed along the inputs in order; qzeros [K/G, N/8]
    packed in order and stored minus one; scales [K/G, N]; g_idx [K], each input's group (with
    act-order the groups are a permutation of the inputs, not runs of G).
Loading unpacks both into codes [N, K], zeros and scales [K/G, N] and g_idx, then repacks for the
bound kernel: "w4a16" (a worker's dequantize-in-the-GEMM kernel over int32 words, eight inputs a word,
kept as column tiles [N/16, K/8, 16] (`tile_words`); act-order inputs are permuted into runs of G
where they form whole groups, for its contiguous-group path),
"cpu_int4pack" (torch's packed int4 GEMM; act-order inputs are permuted into runs of G first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ..errors import ConfigError
from .base import LinearMethod, QuantAxes, QuantizationConfig, tensor_bytes
from .int4_cpu import int4_linear, int4pack_bytes, register_int4pack
from .scope import kernel as provided_kernel

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def pack_int32(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack 4-bit codes eight to an int32 along `dim` (nibble i holds element order[i] of each eight)."""
    codes = codes.to(torch.int32).movedim(dim, -1)
    grouped = codes.reshape(*codes.shape[:-1], -1, 8)[..., list(order)]
    words = (grouped << _shifts(codes.device)).sum(dim=-1, dtype=torch.int64)
    return (words - (words >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of `pack_int32`: int32 words -> uint8 codes, eight per word along `dim`."""
    words = words.movedim(dim, -1)
    nibbles = (words.unsqueeze(-1) >> _shifts(words.device)) & 0xF
    codes = torch.empty_like(nibbles)
    codes[..., list(order)] = nibbles
    return codes.reshape(*words.shape[:-1], -1).movedim(-1, dim).to(torch.uint8)


# Columns a tile of `tile_words`: a decode GEMV reads its column slice (16 or 32 columns) as one
# contiguous stream instead of a 64-byte piece of every word row (N * 4 bytes apart).
W4_TILE = 16


def tile_words(words: torch.Tensor, tile: int = W4_TILE) -> torch.Tensor:
    """Words [K/8, N] -> column tiles [ceil(N / tile), K/8, tile], the last tile zero-padded."""
    rows, n = words.shape
    padded = F.pad(words, (0, -n % tile))
    return padded.reshape(rows, -1, tile).transpose(0, 1).contiguous()


def untile_words(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `tile_words` for N = n."""
    return tiles.transpose(0, 1).reshape(tiles.shape[1], -1)[:, :n]


def dequantize_w4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Weight [N, K] from codes [N, K], zeros and scales [groups, N] and each input's group g_idx [K]:
    (q - z) s for integer zero codes, q s + b for float offsets (GGUF)."""
    g = g_idx.long()
    if zeros.is_floating_point():
        return codes.float() * scales[g].t().float() + zeros[g].t().float()
    return (codes.float() - zeros[g].t().float()) * scales[g].t().float()


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """The "w4a16" kernel's contract, as dequantize-then-matmul: qweight [K/8, N] int32 (inputs in
    order) or its `tile_words` tiles, scales [groups, N], zeros [groups, N] (int32 codes or float
    offsets), g_idx [K] -> x @ W.T in x's dtype."""
    if qweight.dim() == 3:
        qweight = untile_words(qweight, scales.shape[1])
    codes = unpack_int32(qweight, 0).t()
    return (x.float() @ dequantize_w4(codes, zeros, scales, g_idx).t()).to(x.dtype)


def register_w4a16(layer, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                   group_size: int, perm: torch.Tensor | None = None) -> None:
    """Keep the "w4a16" kernel's operands as the layer's buffers: codes [N, K] packed to [K/8, N]
    words in `tile_words` tiles, scales and zeros [groups, N] (int32 codes or float offsets),
    g_idx [K], its contiguous `group_size` (0: gather through g_idx) and the input permutation
    applied per call (None: none).
    Buffers, so the model's tensors count them (`corectl plan` compares), non-persistent: the
    checkpoint holds another layout."""
    layer.w4_group_size = group_size
    served = {"w4_perm": perm, "w4_qweight": tile_words(pack_int32(codes.t(), 0)), "w4_scales": scales.contiguous(),
              "w4_zeros": zeros.contiguous(), "w4_g_idx": g_idx}
    for name, tensor in served.items():
        layer.register_buffer(name, tensor, persistent=False)


def w4a16_bytes(out_features: int, in_features: int, group_bytes: int) -> int:
    """Bytes `register_w4a16` keeps for an [N, K] weight whose scales and zeros (or offsets) take
    `group_bytes`: two codes a byte (N padded to whole tiles) and an int32 g_idx entry per input
    (the permutation apart)."""
    padded = out_features + -out_features % W4_TILE
    return padded * in_features // 2 + group_bytes + in_features * torch.int32.itemsize


def w4a16_linear(gemm, layer, rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ W.T + bias through `gemm` on the operands `register_w4a16` kept."""
    rows = rows if layer.w4_perm is None else rows[:, layer.w4_perm]
    out = gemm(rows, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_g_idx,
               group_size=layer.w4_group_size)
    return out if layer.bias is None else out + layer.bias


@dataclass(frozen=True)
class _W4Config(QuantizationConfig):
    kernels = ("w4a16", "cpu_int4pack")
    group_size: int = 128
    desc_act: bool = False
    ignored: tuple[str, ...] = ()

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        if any(part in name for name in layer.checkpoint_weight_names(prefix) for part in self.ignored):
            return None
        return W4LinearMethod(self)


@dataclass(frozen=True)
class AWQConfig(_W4Config):
    name = "awq"

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "AWQConfig":
        qc = _require(quant_config, "awq")
        if qc.get("zero_point", True) is False or qc.get("version", "gemm").lower() != "gemm":
            raise ConfigError("quantization", "AWQ checkpoints are served in the GEMM layout with zero points; "
                              f"this one has version {qc.get('version')!r}, zero_point {qc.get('zero_point')!r}")
        return cls(group_size=int(qc.get("group_size", qc.get("q_group_size", 128))),
                   ignored=tuple(qc.get("modules_to_not_convert") or ()))


@dataclass(frozen=True)
class GPTQConfig(_W4Config):
    name = "gptq"

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "GPTQConfig":
        qc = _require(quant_config, "gptq")
        if qc.get("sym") is False and qc.get("checkpoint_format", "gptq") != "gptq":
            raise ConfigError("quantization", f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not read")
        return cls(group_size=int(qc.get("group_size", 128)), desc_act=bool(qc.get("desc_act", False)),
                   ignored=tuple(qc.get("modules_to_not_convert") or ()))


def _require(quant_config: dict | None, name: str) -> dict:
    if quant_config is None:
        raise ConfigError("quantization", f"{name!r} serves {name.upper()} checkpoints (config.json with a "
                          "quantization_config); it does not quantize dense weights on the fly")
    bits = quant_config.get("bits", quant_config.get("w_bit", 4))
    if bits != 4:
        raise ConfigError("quantization", f"{name} checkpoints with {bits}-bit weights are not supported (4-bit are)")
    return quant_config


def _group_runs(g_idx: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(perm, order): inputs `perm` form runs of G, run i being group order[i]; None when some
    group does not hold exactly G of these inputs (act-order on a row-parallel rank). Load time
    only: it reads device values back."""
    perm = torch.argsort(g_idx.long(), stable=True)
    groups = g_idx.long()[perm].view(-1, g)
    if not bool((groups == groups[:, :1]).all()):
        return None
    return perm, groups[:, 0]


def _is_identity(perm: torch.Tensor) -> bool:
    return bool((perm == torch.arange(perm.numel(), device=perm.device)).all())


class W4LinearMethod(LinearMethod):
    def __init__(self, config: _W4Config):
        self.config = config
        self.gemm = provided_kernel("w4a16") if config.kernel == "w4a16" else None

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k, g = layer.out_features, layer.in_features, self.config.group_size
        if k % g or n % 8 or k % 8:
            raise ConfigError("model", f"a {n}x{k} 4-bit layer needs inputs in whole groups of {g} and outputs "
                              "in multiples of 8 on each rank")
        # With act-order a row-parallel rank's inputs may belong to any group: it keeps every scale.
        whole = self.config.desc_act and layer.first_input is not None
        groups = layer.full_in_features // g if whole else k // g
        group_axis = None if whole else 0
        if self.config.name == "awq":
            layer.register_quant_param("qweight", torch.zeros(k, n // 8, dtype=torch.int32), QuantAxes(1, 8, 0, 1))
        else:
            layer.register_quant_param("qweight", torch.zeros(k // 8, n, dtype=torch.int32), QuantAxes(1, 1, 0, 8))
            layer.register_quant_param("g_idx", torch.zeros(k, dtype=torch.int32), QuantAxes(None, 1, 0, 1))
        layer.register_quant_param("qzeros", torch.zeros(groups, n // 8, dtype=torch.int32),
                                   QuantAxes(1, 8, group_axis, g))
        layer.register_quant_param("scales", torch.zeros(groups, n, dtype=dtype), QuantAxes(1, 1, group_axis, g))

    def process_weights_after_loading(self, layer) -> None:
        codes, zeros, g_idx = self._unpacked(layer)
        scales = layer.scales.data
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        if self.gemm is not None:
            self._to_w4a16(layer, codes, zeros, scales, g_idx)
            return
        self._to_int4pack(layer, codes, zeros, scales, g_idx)

    def served_bytes(self, layer) -> int:
        """w4a16: codes as int32 words in column tiles, the scales, fp32 offsets and g_idx; int4pack: its
        packed layout, plus the input permutation with act-order. An act-order rank whose inputs
        do not form whole groups keeps a dense weight (int4pack) or gathers by g_idx without a
        permutation (w4a16) instead, which only its g_idx shows: planned as packed, permuted."""
        n, k = layer.out_features, layer.in_features
        permutation = k * torch.int64.itemsize if self.config.desc_act else 0
        if self.gemm is not None:
            offsets = layer.scales.shape[0] * n * torch.float32.itemsize
            served = w4a16_bytes(n, k, tensor_bytes(layer.scales) + offsets)
        else:
            served = int4pack_bytes(n, k, self.config.group_size)
        return served + permutation + tensor_bytes(layer.bias)

    def _to_w4a16(self, layer, codes, zeros, scales, g_idx) -> None:
        """Inputs permuted into runs of G where act-order allows (the activations are permuted to
        match per call), so the kernel takes its contiguous-group path (`group_size`) and loads
        each group's scales once instead of gathering them per input; a rank whose inputs do not
        form whole groups keeps g_idx and the gathering path. Zero codes become fp32 offsets
        b = -z s, exact (s has at most 11 significant bits, z 4): the kernel then adds b sum x
        instead of converting z per column and group."""
        g = self.config.group_size
        offsets = -(zeros.float() * scales.float())
        runs = _group_runs(g_idx, g)
        if runs is None:
            register_w4a16(layer, codes, scales, offsets, g_idx, 0)
            return
        perm, order = runs
        g_idx = torch.arange(g_idx.numel(), dtype=torch.int32, device=g_idx.device) // g
        register_w4a16(layer, codes[:, perm], scales[order], offsets[order], g_idx, g,
                       None if _is_identity(perm) else perm)

    def _unpacked(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes [N, K], zero codes [groups, N], g_idx [K] (int32) from the checkpoint's layout."""
        g = self.config.group_size
        if self.config.name == "awq":
            codes = unpack_int32(layer.qweight.data, 1, AWQ_ORDER).t()
            zeros = unpack_int32(layer.qzeros.data, 1, AWQ_ORDER)
            g_idx = torch.arange(layer.in_features, dtype=torch.int32, device=codes.device) // g
            return codes, zeros, g_idx
        codes = unpack_int32(layer.qweight.data, 0).t()
        zeros = unpack_int32(layer.qzeros.data, 1).to(torch.int32) + 1  # GPTQ stores zero - 1
        if not self.config.desc_act:
            return codes, zeros, torch.arange(layer.in_features, dtype=torch.int32, device=codes.device) // g
        g_idx = layer.g_idx.data
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= zeros.shape[0]:
            raise ConfigError("model", f"g_idx names groups outside 0..{zeros.shape[0] - 1}: the GPTQ checkpoint "
                              "does not match its group_size")
        return codes, zeros, g_idx

    def _to_int4pack(self, layer, codes, zeros, scales, g_idx) -> None:
        """Permute the inputs so each group is a run of G (act-order), then pack; a rank whose
        inputs do not form whole groups (act-order under row parallelism) keeps dense weights."""
        runs = _group_runs(g_idx, self.config.group_size)
        if runs is None:
            layer.register_buffer("dense_weight", dequantize_w4(codes, zeros, scales, g_idx).to(scales.dtype),
                                  persistent=False)
            return
        perm, order = runs
        zeros_f, scales_f = zeros[order].t().float(), scales[order].t().float()
        layer.register_buffer("int4_perm", None if _is_identity(perm) else perm, persistent=False)
        register_int4pack(layer, codes[:, perm], scales_f, (8 - zeros_f) * scales_f)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.gemm is not None:
            out = w4a16_linear(self.gemm, layer, rows)
        elif hasattr(layer, "dense_weight"):
            out = F.linear(rows, layer.dense_weight.to(rows.dtype), layer.bias)
        else:
            rows = rows if layer.int4_perm is None else rows[:, layer.int4_perm]
            out = int4_linear(rows, layer.packed_weight, layer.scale_zero, self.config.group_size, layer.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
