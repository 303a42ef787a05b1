"""Piecewise CUDA graphs: steps that are not pure decodes replay the model in graphs cut at attention.

A step whose requests do not all decode one token (a prefill chunk beside the running decodes,
or a prompt's last block recomputed after a prefix-cache hit) cannot replay a decode graph, since
its attention depends on every sequence's query length. Run eagerly, a 32-layer model spends
~50 ms of Python launching kernels on an H100 host, several times the device's time for such a
step, and every running stream waits for it: that is the ITL tail of online loads, and why a
structured-output load (whose requests end at scattered times, so prompts join often) fell behind
an unconstrained one. As vLLM does, the forward pass is captured for a set of token counts in
pieces cut at each attention call. Replaying a step replays piece 0, runs layer 0's attention
eagerly with the step's own metadata, replays piece 1, and so on: the host launches one graph and
one attention call a layer.

Memory. The pieces of every token count share one pool and replay in capture order. What a
piece hands a later one across a cut (the residual, the hidden states) stays allocated because
the model's code holds it over the attention call. The query, key and value tensors a call reads
are kept only as non-owning views, so later pieces may reuse their memory once the call has read
them; every call writes into one output buffer, which the next piece reads before the next call
overwrites it. Padding rows (a step of n tokens replays the smallest captured count >= n) run the
dense layers on stale inputs and never reach attention, the KV cache or the sampler.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from corectl.attention import AttentionBatch, ForwardContext

# Token counts captured: fine steps where padding costs compute, none past where a step's device
# time outweighs the eager launches anyway (~2k tokens of an 8B model).
PIECEWISE_TOKENS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048)
_INT_TYPESTR = {1: "|i1", 2: "<i2", 4: "<i4", 8: "<i8"}


def piecewise_token_counts(max_num_tokens: int) -> list[int]:
    """The token counts to capture for a step budget of `max_num_tokens`. A budget between two of
    `PIECEWISE_TOKENS` is captured itself, or its fullest steps (those of a decode instance's prompt
    chunks, say) would run eagerly."""
    counts = [n for n in PIECEWISE_TOKENS if n <= max_num_tokens]
    if counts and max_num_tokens < PIECEWISE_TOKENS[-1] and counts[-1] != max_num_tokens:
        counts.append(max_num_tokens)
    return counts


class _DeviceArray:
    """A CUDA array interface over `t`'s memory that does not keep it allocated."""

    def __init__(self, t: torch.Tensor):
        size = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "strides": tuple(s * size for s in t.stride()),
            "typestr": _INT_TYPESTR[size], "data": (t.data_ptr(), False), "version": 3,
        }


def non_owning_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory (same shape, strides and dtype) that does not hold it: the caching
    allocator may hand the memory out again once `t` is gone."""
    if t.numel() == 0:
        return t
    return torch.as_tensor(_DeviceArray(t), device=t.device).view(t.dtype)


@dataclass
class _Cut:
    """One attention call between two pieces, replayed eagerly."""
    method: str
    args: list[Any]           # the capture's metadata stands where each step's goes
    kwargs: dict[str, Any]
    token_args: list[int]     # positions of the tensors with a row a token (sliced to the step's)
    out: torch.Tensor         # where the next piece reads the call's output, a row a token


class _CuttingBackend:
    """Stands for the attention backend while a token count is captured: each attention call ends
    the piece being captured, runs eagerly (outside any graph), and starts the next piece."""

    def __init__(self, backend, kv_caches: list[torch.Tensor], num_tokens: int, out_buffer: "_OutputBuffer", pool):
        self._backend, self._num_tokens = backend, num_tokens
        self._kv_ids = {id(kv) for kv in kv_caches}
        self._out_buffer, self._pool = out_buffer, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[_Cut] = []

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self._cut("forward", args, kwargs)

    def forward_latent(self, *args, **kwargs) -> torch.Tensor:
        return self._cut("forward_latent", args, kwargs)

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def abandon(self) -> None:
        """End a capture that failed part-way (out of memory, say), so the stream runs eagerly again."""
        if torch.cuda.is_current_stream_capturing():
            try:
                self.graphs[-1].capture_end()
            except RuntimeError:
                pass  # the capture was already invalidated; ending it is all that was wanted

    def _cut(self, method: str, args: tuple, kwargs: dict) -> torch.Tensor:
        self.end()
        result = getattr(self._backend, method)(*args, **kwargs)
        if not isinstance(result, torch.Tensor) or result.shape[0] != self._num_tokens:
            raise RuntimeError(f"attention {method} returned no tensor of a row a token")
        out = self._out_buffer.view(result)
        out.copy_(result)
        token_args = [i for i, a in enumerate(args) if self._is_token_tensor(a)]
        kept = [non_owning_view(a) if i in token_args else a for i, a in enumerate(args)]
        self.cuts.append(_Cut(method, kept, dict(kwargs), token_args, out))
        self.begin()
        return out

    def _is_token_tensor(self, a: Any) -> bool:
        return (isinstance(a, torch.Tensor) and id(a) not in self._kv_ids and a.dim() >= 1
                and a.shape[0] == self._num_tokens)


class _OutputBuffer:
    """The memory every attention call's output is copied into, sized by the first (largest) capture."""

    def __init__(self):
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def view(self, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(like.dtype)
        if buffer is None:
            buffer = self._buffers[like.dtype] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        if buffer.numel() < like.numel():
            raise RuntimeError("piecewise graphs must be captured largest token count first")
        return buffer[: like.numel()].view(like.shape)


@dataclass
class PiecewiseGraph:
    """The pieces of one token count and the attention calls between them."""
    graphs: list[torch.cuda.CUDAGraph]
    cuts: list[_Cut]
    metadata: Any             # the capture's, replaced by each step's
    output: torch.Tensor

    def replay(self, backend, metadata, num_tokens: int) -> torch.Tensor:
        """The hidden states of a step's `num_tokens` tokens, whose inputs are in the static buffers."""
        for graph, cut in zip(self.graphs, self.cuts):
            graph.replay()
            args = [metadata if a is self.metadata else a[:num_tokens] if i in cut.token_args else a
                    for i, a in enumerate(cut.args)]
            cut.out[:num_tokens].copy_(getattr(backend, cut.method)(*args, **cut.kwargs))
        self.graphs[-1].replay()
        return self.output[:num_tokens]


def capture_batch(num_tokens: int, block_size: int, device: torch.device) -> AttentionBatch:
    """A capture's attention batch: one sequence of `num_tokens` new tokens over null blocks that
    stores nothing (slot -1). Attention runs eagerly at replay, so only its shapes matter here."""
    blocks = -(-num_tokens // block_size)
    return AttentionBatch(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, blocks, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_lens_host=[num_tokens], seq_lens_host=[num_tokens],
        max_query_len=num_tokens, max_seq_len=num_tokens, block_size=block_size,
    )


class PiecewiseGraphs:
    """Piecewise graphs of a model for several token counts, over static input buffers."""

    def __init__(self, counts: list[int], device: torch.device):
        self.counts = sorted(counts)
        self.input_ids = torch.zeros(self.counts[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.counts[-1], dtype=torch.int64, device=device)
        self.graphs: dict[int, PiecewiseGraph] = {}
        self._out = _OutputBuffer()

    def bucket(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.counts, num_tokens)
        return self.counts[i] if i < len(self.counts) else None

    def capture(self, model, backend, kv_caches: list[torch.Tensor], block_size: int, pool) -> None:
        """Capture every count, largest first (the output buffer and the pool are sized by it), all
        on one side stream: cuBLAS keeps a workspace per stream, which a stream per count would
        multiply inside the pool."""
        stream = torch.cuda.Stream(self.input_ids.device)
        for n in reversed(self.counts):
            self.graphs[n] = self._capture(n, model, backend, kv_caches, block_size, pool, stream)

    def _capture(self, n: int, model, backend, kv_caches, block_size: int, pool,
                 stream: torch.cuda.Stream) -> PiecewiseGraph:
        metadata = backend.build_metadata(capture_batch(n, block_size, self.input_ids.device), check_indices=False)
        args = (self.input_ids[:n], self.positions[:n])
        cutter = _CuttingBackend(backend, kv_caches, n, self._out, pool)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Once eagerly on the capture stream first: the kernels compile and cuBLAS sets up its
            # workspace for the stream outside any capture.
            model(*args, ForwardContext(backend, metadata, kv_caches))
            torch.cuda.synchronize()
            cutter.begin()
            try:
                output = model(*args, ForwardContext(cutter, metadata, kv_caches))
            except BaseException:
                cutter.abandon()
                raise
            cutter.end()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return PiecewiseGraph(cutter.graphs, cutter.cuts, metadata, output)

    def run(self, bucket: int, backend, metadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's hidden states from the pieces of `bucket` tokens, the count `bucket()` gave for it."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        return self.graphs[bucket].replay(backend, metadata, n)
