"""The attention-backend contract: how models reach the paged KV cache.

KV cache layout (one tensor per layer, shared by every backend so kernels interoperate):
    [parts, num_blocks, block_size, num_kv_heads, head_dim]
with parts = 2 (index 0 = keys, 1 = values), or parts = 1 for a model whose `KVCacheLayout` says its
one row per token serves as both (multi-head latent attention, `AttentionBackend.forward_latent`).
Slot `s` is block `s // block_size`, offset `s % block_size`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ConfigError


@dataclass(frozen=True)
class KVCacheLayout:
    """What a layer's paged cache holds per token, for a model whose cache rows are not its config's
    KV heads (the model's `kv_cache_layout` attribute): `parts` tensors of num_kv_heads x head_dim.
    DeepSeek's multi-head latent attention caches one part of one "head": the normalized latent and
    the shared rotated key, kv_lora_rank + qk_rope_head_dim numbers per token for all heads."""

    num_kv_heads: int
    head_dim: int
    parts: int = 2


@dataclass
class AttentionBatch:
    """Hardware-neutral description of one step's attention work, tensors on the worker's device.

    Sequences are packed: the T query tokens of B sequences are concatenated in batch order.
    seq_lens[i] = context length after this step (cached prefix + new tokens);
    query_lens[i] = seq_lens[i] - num_computed[i]. Host lists mirror the tensors so CPU code
    paths never read device memory.
    """

    query_start_loc: torch.Tensor      # [B + 1] int32
    seq_lens: torch.Tensor             # [B] int32
    block_tables: torch.Tensor         # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor         # [T] int64
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Per sequence, context positions [start, end) whose tokens attend to each other both ways
    # (an image's tokens in Gemma 3); None: every query attends causally. Each span lies wholly
    # within this step's query tokens (the scheduler never splits one across steps), so a query in
    # a span sees every key up to the span's end: `query_key_ends`.
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # Pure-decode batches only: the rows come in groups of this many over one block table (a CUDA
    # graph's verify step: k + 1 decode rows a request, each ending at its own position, padding
    # rows of seq_len 0 after a request's tokens), so a backend may read each group's K/V once.
    rows_per_seq: int = 1
    # Pure-decode batches, where the backend `uses_decode_order`: the row groups longest context
    # first (int32 [B / rows_per_seq], `longest_first`), the order its programs may start in so a
    # ragged batch's long contexts do not run alone at the end. None: batch order.
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def longest_first(seq_lens: np.ndarray, rows_per_seq: int = 1) -> np.ndarray:
    """`AttentionBatch.decode_order` of a pure-decode step's `seq_lens` (a group's length is its
    longest row's), ties in batch order."""
    groups = np.asarray(seq_lens).reshape(-1, rows_per_seq).max(axis=1)
    return np.argsort(-groups.astype(np.int64), kind="stable").astype(np.int32)


def query_key_ends(batch: AttentionBatch) -> list[int] | None:
    """One bound per packed query token, the first context position it does not see: its own
    position + 1, or the end of the bidirectional span holding it. None when the batch has no spans."""
    if not batch.bidirectional_spans:
        return None
    ends: list[int] = []
    for spans, q_len, s_len in zip(batch.bidirectional_spans, batch.query_lens_host, batch.seq_lens_host):
        row = list(range(s_len - q_len + 1, s_len + 1))
        for start, end in spans:
            for pos in range(max(start, s_len - q_len), min(end, s_len)):
                row[pos - s_len + q_len] = end
        ends += row
    return ends


class AttentionBackend(abc.ABC):
    """One instance per worker; `forward` is called by every attention layer of the model."""

    name: str = ""
    #: Whether a pure-decode step's forward can be captured in a device graph (CUDA or HIP graphs)
    #: and replayed with new inputs. A backend that says so, given metadata built with
    #: `check_indices=False` for a batch of fixed size, reads nothing back from the device during
    #: `forward`, launches the same work on every replay, and takes everything that changes
    #: between steps from the metadata's tensors, which the runner refills in place. Graph
    #: runners run every step eagerly with any other backend.
    supports_graph_capture: bool = False
    #: The `EngineConfig.kv_cache_dtype` values this backend reads and writes; the engine refuses
    #: others at startup (`check_kv_cache_dtype`). "auto" caches hold the model's dtype;
    #: "fp8"/"fp8_e4m3" caches hold torch.float8_e4m3fn (values divided by a per-tensor scale,
    #: 1.0 unless calibrated); "float16" caches hold torch.float16 whatever the model's dtype.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    #: Whether `forward` takes `sinks` (learned per-head logits joining each softmax's denominator,
    #: gpt-oss). The model's `Attention` layer refuses a backend without them, by name, and passes
    #: `sinks` only to backends that take it.
    supports_sinks: bool = False
    #: Whether `forward` takes `attention_chunk` (chunked local attention, Llama 4); the `Attention`
    #: layer refuses a backend without it, by name.
    supports_chunked_attention: bool = False

    @classmethod
    def check_kv_cache_dtype(cls, kv_cache_dtype: str) -> None:
        """Raise ConfigError when this backend does not store `kv_cache_dtype` caches; the engine
        asks once the backend is chosen, before any weight loads."""
        if kv_cache_dtype not in cls.kv_cache_dtypes:
            raise ConfigError("kv_cache_dtype", f"the {cls.name!r} attention backend stores only "
                              f"{', '.join(cls.kv_cache_dtypes)} KV caches, not {kv_cache_dtype!r}; use "
                              "--kv-cache-dtype auto or a backend that supports it (triton, on GPUs)")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.block_size = block_size

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       parts: int = 2) -> tuple[int, ...]:
        return (parts, num_blocks, block_size, num_kv_heads, head_dim)

    def uses_decode_order(self, num_groups: int, rows_per_seq: int, max_seq_len: int) -> bool:
        """Whether `build_metadata` reads `AttentionBatch.decode_order` for a pure-decode batch of
        `num_groups` row groups of `rows_per_seq` rows, contexts up to `max_seq_len` (a graph's:
        the model's length). Runners fill it only where this says so: it costs a host argsort and
        a copy a step. False by default."""
        return False

    def fuses_rotary(self, metadata: Any) -> bool:
        """Whether `forward` takes `rotation` (a `Rotation`) in a step of this metadata: q and k
        arrive unrotated and the backend rotates them as it stores the new keys (one launch where a
        layer ran two). Layers pass one only where this says so, and only for rotations it
        describes (whole heads). False by default."""
        return False

    @abc.abstractmethod
    def build_metadata(self, batch: AttentionBatch, check_indices: bool = True) -> Any:
        """Turn the neutral batch description into whatever `forward` needs (built once per step).

        `check_indices=False` says the batch's block tables, slot mapping and lengths come from
        the engine's own runner, so the backend need not validate them: validation that reads
        device tensors back is a host sync each step, and a graph capture forbids it. Model
        runners always pass False; the default serves direct callers.
        """

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim].

        Writes k/v into the cache at `slot_mapping`, then attends causally over each sequence's
        cached prefix plus its new tokens, except that a query inside one of the batch's
        `bidirectional_spans` also sees the later keys of its span (key j is visible to query i if
        j <= i or both lie in the same span; the layer's window still applies). Returns
        [T, num_heads * head_dim].

        Per layer (the model's `Attention` module passes them on every call):
        - `sliding_window` W: the token at position p attends to keys p - W < j <= p only (W keys,
          its own included: transformers' convention); None attends to the whole prefix. Keys
          before the window must get no weight whatever the cache holds there: when every layer
          of a model is windowed, the KV manager returns the blocks that fall wholly before the
          window of a sequence's first new token to the pool and other requests overwrite them
          (docs/architecture.md, section 6). The Triton kernels do not even read them.
        - `logits_soft_cap` c: each score s (after `scale`) becomes c * tanh(s / c) before the
          mask and softmax (Gemma 2); None leaves scores as they are.
        - `sinks` [num_heads] (keyword, only for backends with `supports_sinks`): head h's softmax
          denominator gains exp(sinks[h]), a key with that logit and a zero value (gpt-oss), so a
          query may give its keys less than all of its weight.
        - `attention_chunk` C (keyword, only for backends with `supports_chunked_attention`): the
          token at position p attends to keys C * (p // C) <= j <= p only, those of its own chunk
          (Llama 4's local layers).
        - `rotation` (keyword, only where `fuses_rotary(meta)`): q and k are still to be rotated as
          it says; q is rotated in place and the cache gets the rotated keys.
        """

    def forward_latent(self, q: torch.Tensor, rows: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float,
                       *, value_dim: int) -> torch.Tensor:
        """Multi-head latent attention in its absorbed form (DeepSeek's MLA) over a one-part cache
        [1, num_blocks, block_size, 1, D] (`KVCacheLayout(1, D, parts=1)`), D = head_dim.

        q: [T, num_heads, D], each head's query already multiplied into the latent space; rows:
        [T, D], the new tokens' cache rows, written at `slot_mapping` first. Every head attends
        causally (as `forward`, no window, cap or spans) with score q . row * scale, and its output
        is the softmax-weighted sum of the rows' first `value_dim` features: [T, num_heads, value_dim].
        Backends without it refuse the model by name.
        """
        raise ConfigError("model", f"this model uses multi-head latent attention, which the {self.name!r} "
                          "attention backend does not implement; use torch_sdpa on CPUs, triton on GPUs")


@dataclass(frozen=True)
class Rotation:
    """The rotary embedding a layer's q and k still need, handed to a backend that `fuses_rotary` in
    the step to apply as it writes the cache: rotate-half (neox) style over whole heads at `positions` [T]
    from the `cos`/`sin` tables [max_positions, head_dim], after Qwen3's per-head RMSNorm of q and
    k where `q_norm`/`k_norm` weights [head_dim] are given (eps `norm_eps`). The model's
    `RotaryEmbedding` is the reference it must equal."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 0.0


@dataclass
class ForwardContext:
    """Passed explicitly through the model's forward: the backend, its metadata, the caches."""

    backend: AttentionBackend
    metadata: Any
    kv_caches: list[torch.Tensor]
