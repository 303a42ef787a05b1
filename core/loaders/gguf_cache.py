"""GGUF checkpoints: dequantized once into a cached Hugging Face-style directory.

The cache holds `config.json`, the tokenizer (`tokenizer.json`, `tokenizer_config.json` with the chat
template), `generation_config.json` and fp32 `*.safetensors`, so later starts load it like any local
checkpoint in seconds instead of parsing and dequantizing the GGUF again.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import CONFIG_MAPPING, AutoTokenizer, PretrainedConfig

from .. import envs
from ..errors import ConfigError, CorectlError, ModelNotFoundError
from .checkpoint_files import INDEX_FILE

logger = logging.getLogger(__name__)

# Part of the cache key: bump it whenever the conversion's output changes, so stale caches are not reused.
CACHE_FORMAT = 1
# Conversion holds one shard of fp32 tensors in memory at a time.
SHARD_BYTES = 2 << 30

# GGUF architecture -> (transformers model_type, architectures entry).
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_cache_dir(path: Path) -> Path:
    """The cache folder for one GGUF file; a changed file (size or mtime) gets a new folder."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return envs.cache_dir() / "gguf" / f"{path.stem}-{key}"


def ensure_converted(path: Path) -> Path:
    """Return the cached HF-style directory for `path`, converting the GGUF first if needed."""
    target = gguf_cache_dir(path)
    # The folder only ever appears through an atomic rename of a finished conversion.
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes starting together (servers, test workers) convert once: the others wait on the cache
    # folder's lock, then find the converted folder.
    lock = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            _convert_into(path, target)
    finally:
        os.close(lock)
    return target


def _convert_into(path: Path, target: Path) -> None:
    logger.info("converting GGUF %s into %s (once; later starts load the cache)", path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(path, staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Where the lock does not reach (another host sharing the folder) a process may finish
            # the same conversion first; its copy is as good as ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and the HF config it converts to; tensor data stays on disk (mapped)."""

    reader: gguf.GGUFReader
    meta: dict
    arch: str
    hf_config: PretrainedConfig

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of the file's tensors by storage type (quantizations such as Q4_1, or F32)."""
        sizes: dict[str, int] = {}
        for tensor in self.reader.tensors:
            sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
        return sizes


def gguf_reader(path: Path) -> gguf.GGUFReader:
    """The parsed GGUF at `path` (tensor data mapped, not read), once per process while the file is
    unchanged: parsing SmolLM2's 49k-token vocabulary alone costs seconds, and planning, the
    tensor-type table and the weight stream each need the parse."""
    stat = Path(path).stat()
    return _parsed(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return _PlainViewReader(path)


class _PlainViewReader(gguf.GGUFReader):
    """The gguf package's reader over a plain ndarray view of its file mapping. Every field part is
    a slice of the mapping, and a slice of an `np.memmap` runs Python code (`memmap.__array_finalize__`)
    where a plain view's does not: SmolLM2's ~300k vocabulary parts took 3.7 s of CPU, 0.95 s plain.
    The view keeps the mapping open; tensor data is still read from disk only when used."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapping: np.memmap) -> None:
        self._plain_data = np.asarray(mapping)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        """Arrays of scalars or strings keep their type, length and bytes, not a part per item:
        corectl reads scalar metadata only (the tokenizer comes from transformers' own GGUF reader),
        and a part per vocabulary entry was most of the parse (~1.5 s of CPU for SmolLM2's)."""
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        start = orig_offs + 12
        kind = gguf.GGUFValueType(int(item_type[0]))
        scalar = self.gguf_scalar_to_np.get(kind)
        if scalar is not None:
            end = start + int(length[0]) * np.dtype(scalar).itemsize
        elif kind == gguf.GGUFValueType.STRING:
            end = _strings_end(self.data, start, int(length[0]), "<" if self.byte_order == "I" else ">")
        else:  # arrays of arrays: the package's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        return end - orig_offs, [item_type, length, self.data[start:end]], [], [gguf.GGUFValueType.ARRAY, kind]


def _strings_end(data: np.ndarray, offset: int, count: int, order: str) -> int:
    """Where `count` GGUF strings (a uint64 length, then the bytes) starting at `offset` end."""
    raw = memoryview(data)
    read = struct.Struct(order + "Q").unpack_from
    for _ in range(count):
        offset += 8 + read(raw, offset)[0]
    return offset


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the GGUF at `path` without reading its weights; raise if the loader cannot convert it."""
    try:
        reader = gguf_reader(path)
    except Exception as exc:  # the gguf package fails on a short or corrupt file with whatever numpy raises
        raise ModelNotFoundError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                                 f"{type(exc).__name__}: {exc}") from exc
    try:
        return _header(path, reader)
    except CorectlError:
        raise
    except Exception as exc:  # metadata of the wrong type or shape, a missing tensor: the file is at fault
        raise ConfigError("model", f"GGUF {path} has metadata the loader cannot use: {type(exc).__name__}: "
                                   f"{exc}") from exc


def _header(path: Path, reader: gguf.GGUFReader) -> GGUFHeader:
    meta = _scalar_metadata(reader)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ConfigError(
            "model",
            f"GGUF {path} has architecture {arch!r}; supported GGUF architectures: {', '.join(ARCHITECTURES)} "
            "(other models load from a Hugging Face safetensors checkpoint)",
        )
    tensor_names = {t.name for t in reader.tensors}
    _check_rope(path, arch, meta, tensor_names)
    return GGUFHeader(reader, meta, arch, _hf_config(reader, meta, arch, tensor_names))


def convert_gguf(path: Path, out: Path) -> None:
    """Write config, tokenizer, generation config and fp32 safetensors for the GGUF at `path` into `out`."""
    header = read_gguf_header(path)
    header.hf_config.save_pretrained(out)
    _write_generation_config(header.meta, out)
    _write_tokenizer(path, out)
    _write_weights(header.reader, header.arch, header.hf_config, out)


def _scalar_metadata(reader) -> dict:
    """Metadata key -> value for scalar and string fields (arrays such as the vocabulary are skipped)."""
    meta = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        part = field.parts[field.data[0]]
        meta[key] = bytes(part).decode("utf-8") if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()
    return meta


def _check_rope(path: Path, arch: str, meta: dict, tensor_names: set[str]) -> None:
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        kind = scaling if scaling != "none" else "llama3 rope_freqs"
        raise ConfigError(
            "model",
            f"GGUF {path} uses rope scaling ({kind}), which the GGUF loader does not convert; "
            "load the model's Hugging Face safetensors checkpoint instead (its config.json carries rope_scaling)",
        )


def _hf_config(reader, meta: dict, arch: str, tensor_names: set[str]):
    model_type, architecture = ARCHITECTURES[arch]
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    fields = dict(
        architectures=[architecture],
        vocab_size=meta.get(f"{arch}.vocab_size", int(embedding.shape[1])),
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=meta[f"{arch}.context_length"],
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if model_type == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return CONFIG_MAPPING[model_type](**fields)


def _write_generation_config(meta: dict, out: Path) -> None:
    ids = {f"{kind}_token_id": meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("bos", "eos")}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in ids.items() if v is not None}, indent=2))


def _write_tokenizer(path: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The chat template goes into tokenizer_config.json, where every tokenizer reader looks for it.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)


def _write_weights(reader, arch: str, hf_config, out: Path) -> None:
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        shard[name] = dequantized_tensor(tensor, arch, hf_config)
        shard_bytes += shard[name].nbytes
        if shard_bytes >= SHARD_BYTES:
            files.append(_save_shard(shard, out, len(files) + 1, weight_map))
            shard, shard_bytes = {}, 0
    if shard:
        files.append(_save_shard(shard, out, len(files) + 1, weight_map))
    if len(files) == 1:
        files[0].rename(out / "model.safetensors")
        return
    renames = {f.name: f"model-{i:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files, 1)}
    for f in files:
        f.rename(out / renames[f.name])
    index = {"metadata": {}, "weight_map": {k: renames[v] for k, v in weight_map.items()}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _save_shard(shard: dict, out: Path, number: int, weight_map: dict[str, str]) -> Path:
    file = out / f"shard-{number:05d}.safetensors"
    save_file(shard, str(file), metadata={"format": "pt"})
    weight_map.update({name: file.name for name in shard})
    return file


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (Hugging Face naming)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ConfigError("model", f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart known to the GGUF loader")


def dequantized_tensor(tensor, arch: str, hf_config) -> torch.Tensor:
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ConfigError(
            "model",
            f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, which this gguf package cannot dequantize: {exc}",
        ) from exc
    # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
    values = np.asarray(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
    if arch == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = hf_config.num_attention_heads if ".attn_q." in tensor.name else hf_config.num_key_value_heads
        values = unpermute_rotary_rows(values, heads)
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def unpermute_rotary_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf row permutation of Q/K, which interleaves each head's rotary
    halves for its own rope kernel (transformers' LlamaTensorProcessor does the same)."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
