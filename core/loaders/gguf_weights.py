"""Streaming a GGUF file's tensors for a model that keeps some of them quantized.

Tensors named in `kept` arrive as `Int4Groups` (codes, scales, mins) for the GGUF linear method,
those in `int8_groups` as `Int8Groups` of their layer's group size; the rest are dequantized to
fp32 exactly as the cached conversion (`gguf_cache`) does. Llama's q/k rows are un-permuted
either way: a row permutation moves whole rows of codes and scales.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .gguf_blocks import Int4Groups, Int8Groups, decode_int4_groups, decode_int8_groups
from .gguf_cache import dequantized_tensor, gguf_reader, hf_tensor_name, read_gguf_header, unpermute_rotary_rows


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF storage type (Q4_1, F32, ...) of every tensor in the file."""
    return {hf_tensor_name(t.name): t.tensor_type.name for t in gguf_reader(path).tensors}


def iter_gguf_weights(path: Path, hf_config, kept: frozenset[str], int8_groups: dict[str, int] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor | Int4Groups | Int8Groups]]:
    header = read_gguf_header(path)
    int8_groups = int8_groups or {}
    for tensor in header.reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name not in kept and name not in int8_groups:
            yield name, dequantized_tensor(tensor, header.arch, hf_config)
            continue
        rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)
        if name in kept:
            groups = decode_int4_groups(tensor.tensor_type.name, rows)
        else:
            groups = decode_int8_groups(tensor.tensor_type.name, rows, int8_groups[name])
        heads = _rotary_heads(tensor.name, header.arch, hf_config)
        if heads:
            groups = type(groups)(*(torch.from_numpy(unpermute_rotary_rows(t.numpy(), heads)) for t in groups))
        yield name, groups


def _rotary_heads(gguf_name: str, arch: str, hf_config) -> int | None:
    kind = gguf_name.split(".")[-2]
    if arch != "llama" or kind not in ("attn_q", "attn_k"):
        return None
    return hf_config.num_attention_heads if kind == "attn_q" else hf_config.num_key_value_heads
