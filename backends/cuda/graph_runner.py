"""The model runner of the CUDA and ROCm platforms: one-copy pinned uploads and decode CUDA graphs.

Uploads: a step's host arrays are packed into one pinned buffer and cross in one asynchronous
copy; the tensors the model reads are views of the device copy. The staging buffer comes from
torch's caching host allocator, which does not hand it out again before the copy has run, so a
step never waits for the previous step's transfers.

Graphs: a pure-decode step (one token per request) replays the graph captured for the smallest
batch-size bucket that holds it, padded with rows that store nothing (slot -1) and attend to
nothing (seq_len 0); backends/triton/attention/backend.py lists what must stay fixed across replays.
A verify step (speculative decoding: every request's newest token and its drafts, all sampled)
replays graphs of its own, captured with k + 1 rows a request: request i's tokens fill rows
i(k + 1) onwards, a request with fewer drafts leaves padding rows after its tokens, and row j is a
decode row that ends at its own position, over the request's block table, so it attends causally
to the rows before it in the request (their K/V is stored before any row attends) and no further.
The attention kernel reads each request's K/V once for its k + 1 rows (`rows_per_seq`); the step's
outputs are gathered back to token order. Verify buckets count requests, up to `max_num_seqs` or
MAX_GRAPH_BATCH rows (CORECTL_GRAPH_VERIFY=0 keeps verify steps eager). Graphs are keyed by
(rows a request, requests) and captured largest first into one memory pool, so the smaller graphs
reuse the largest one's activation memory (one graph runs at a time). Every graph reads the first rows of one set
of static input buffers sized for the largest bucket, and keeps the output tensor its capture
produced. Other steps of up to 2,048 tokens (prefill chunks, mixed steps) replay piecewise graphs
cut at each attention call (`piecewise.py`), where the runner allows them; larger ones run eagerly.

Pipeline stages capture their own graphs: a stage after the first reads the previous stage's
activations from static buffers too (received into them before the replay), and one before the
last sends the activations its graph produced. The transfers stay outside the graphs; every stage
pads a step to the same bucket, so each receives the rows its peer sends.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from corectl.attention import AttentionBatch, ForwardContext, longest_first
from corectl.distributed import get_tp
from corectl.models.pipeline import IntermediateTensors
from corectl.worker.inflight import HostFetch
from corectl.worker.model_runner import ModelRunner, StepInputs, logits_index
from corectl.worker.request_states import HostStep

from ..triton.gemm import padded_rows
from .piecewise import PiecewiseGraphs

logger = logging.getLogger("corectl.cuda")

# vLLM's default capture limit: past it a graph saves little launch time next to the step's work.
MAX_GRAPH_BATCH = 512
# Every packed array starts 16-byte aligned: Triton specializes kernels on whether a pointer is
# 16-byte aligned, so an offset that shifted with the step's sizes would compile new variants of
# the attention kernels in the middle of serving.
_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32}


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to and including
    min(max_num_seqs, limit), so every batch up to that size pads by fewer than 8 rows."""
    top = min(max_num_seqs, limit)
    return [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]


def graph_bucket(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `num_seqs` rows; None above the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


GraphKey = tuple[int, int]  # (rows a request: 1, or k + 1 for verify steps; requests)


def choose_graph(sizes: Mapping[int, Sequence[int]], max_blocks: int, host: HostStep) -> GraphKey | None:
    """The captured graph that replays this step, or None to run it eagerly. `sizes` maps rows a
    request (1: decode graphs; k + 1: verify graphs) to the captured request counts, ascending."""
    if host.block_tables.shape[1] > max_blocks:
        return None
    if host.max_query_len == 1:
        rows = 1
    else:
        rows = max((r for r in sizes if r > 1), default=0)
        if not (host.verifies and host.samples_every_row) or host.max_query_len > rows:
            return None
    bucket = graph_bucket(sizes.get(rows, ()), host.num_seqs)
    return None if bucket is None else (rows, bucket)


def pad_decode_step(host: HostStep, size: int, positions: np.ndarray | None = None) -> list[np.ndarray]:
    """A pure-decode step's input_ids, positions (the model's: `positions`, or the step's cache
    positions), slot_mapping, seq_lens and block_tables padded to `size` rows. Padding rows read
    token 0 at position 0, store nothing (slot -1) and attend to nothing (seq_len 0, a row of
    null blocks)."""
    return [
        _padded(host.input_ids, size, 0),
        _padded(host.positions if positions is None else positions, size, 0),
        _padded(host.slot_mapping, size, -1),
        _padded(host.seq_lens, size, 0),
        _padded(host.block_tables, size, 0),
    ]


def pad_verify_step(host: HostStep, rows: int, groups: int,
                    positions: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """A verify step laid out `rows` to a request for `groups` requests (`pad_decode_step`'s five
    arrays), and the row each token went to. Token j of request i goes to row i * rows + j, a
    decode row ending at its own position over the request's block table; the rows after a
    request's tokens, and whole padding groups, are padding rows as in `pad_decode_step`."""
    # Each token moves from its packed row by its request's (row start - query start).
    shift = np.arange(len(host.query_lens)) * rows - np.asarray(host.query_starts)
    token_rows = np.arange(host.num_tokens) + np.repeat(shift, host.query_lens)
    size = rows * groups

    def scatter(values: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(size, fill, dtype=values.dtype)
        out[token_rows] = values
        return out

    return [
        scatter(host.input_ids, 0),
        scatter(host.positions if positions is None else positions, 0),
        scatter(host.slot_mapping, -1),
        scatter((host.positions + 1).astype(np.int32), 0),
        _padded(np.repeat(host.block_tables, rows, axis=0), size, 0),
    ], token_rows.astype(np.int64)


def _padded(a: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full((size, *a.shape[1:]), fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def packed_layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offset of each array in one buffer holding them all, and the buffer's size."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def pack(buffer: np.ndarray, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    """Copy `arrays` into the uint8 `buffer` at `offsets`."""
    for a, offset in zip(arrays, offsets):
        buffer[offset: offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def unpack(buffer: torch.Tensor, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of a packed uint8 `buffer` (on any device) with each array's dtype and shape."""
    return [buffer[offset: offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets)]


class _StaticDecodeInputs:
    """The input tensors every decode graph reads; a graph of batch size n uses the first n rows."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device,
                 intermediate: IntermediateTensors | None = None):
        # A pipeline stage after the first: the previous stage's activations, received each replay.
        self.intermediate = intermediate
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # One query token per row, padding included, so the starts never change.
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        # The row groups longest context first (`AttentionBatch.decode_order`), for a backend that reads it.
        self.decode_order = torch.arange(max_batch, dtype=torch.int32, device=device)

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def attention_batch(self, size: int, max_model_len: int, block_size: int, rows_per_seq: int = 1,
                        ordered: bool = False) -> AttentionBatch:
        """The batch a graph of `size` rows (`rows_per_seq` a request) is captured with: bounded by
        the model's max length, so the kernels' launch choices (split count) hold for any context
        that can occur."""
        return AttentionBatch(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            query_lens_host=[1] * size,
            seq_lens_host=[max_model_len] * size,
            max_query_len=1,
            max_seq_len=max_model_len,
            block_size=block_size,
            rows_per_seq=rows_per_seq,
            decode_order=self.decode_order[: size // rows_per_seq] if ordered else None,
        )

    def load(self, size: int, padded: list[torch.Tensor], order: torch.Tensor | None = None) -> None:
        """Copy a step's padded device inputs (see `pad_decode_step`) into the first `size` rows, and
        its groups' order (`longest_first`) for a graph captured with one."""
        input_ids, positions, slot_mapping, seq_lens, block_tables = padded
        if order is not None:
            self.decode_order[: order.shape[0]].copy_(order)
        self.input_ids[:size].copy_(input_ids)
        self.positions[:size].copy_(positions)
        self.slot_mapping[:size].copy_(slot_mapping)
        self.seq_lens[:size].copy_(seq_lens)
        # Columns past the step's longest sequence keep stale ids that no row reads.
        self.block_tables[:size, : block_tables.shape[1]].copy_(block_tables)


@dataclass
class _DecodeGraph:
    size: int                 # rows
    graph: torch.cuda.CUDAGraph
    # The final hidden states, or a pipeline stage's activations for the next stage.
    output: torch.Tensor | IntermediateTensors
    attn: AttentionBatch


@dataclass
class _GraphStepInputs(StepInputs):
    graph: _DecodeGraph
    # A verify graph's row of each token (its outputs come back in token order); None: rows are tokens.
    token_rows: torch.Tensor | None = None


class CUDAGraphModelRunner(ModelRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graphs: dict[GraphKey, _DecodeGraph] = {}
        # Rows a request -> captured request counts (`choose_graph`).
        self._graph_sizes: dict[int, list[int]] = {}
        self._static: _StaticDecodeInputs | None = None
        self.piecewise: PiecewiseGraphs | None = None

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().set_kv_caches(kv_caches)
        # Captured launches hold the previous caches' addresses.
        self.graphs, self._graph_sizes, self.piecewise = {}, {}, None

    @torch.inference_mode()
    def capture_graphs(self, max_model_len: int, decode_sizes: list[int], rows_per_seq: int = 1,
                       piecewise_counts: Sequence[int] = ()) -> None:
        """Capture decode graphs of `decode_sizes` requests (the KV caches must be set; none: decodes
        replay the pieces), with `rows_per_seq` > 1 (k + 1) verify graphs of that many rows a
        request, and piecewise graphs of `piecewise_counts` tokens for the other steps."""
        if not self.backend.supports_graph_capture:
            logger.warning("attention backend %r cannot be captured in CUDA graphs; decoding eagerly",
                           self.backend.name)
            return
        if not getattr(self.model, "supports_graph_capture", True):
            reason = getattr(self.model, "graph_capture_blocker", "") or "its forward reads values back to the host"
            logger.warning("%s runs outside CUDA graphs (%s); decoding eagerly", type(self.model).__name__, reason)
            return
        if decode_sizes:
            self._capture_decode(max_model_len, decode_sizes, rows_per_seq)
        if not piecewise_counts:
            return
        blocker = self._piecewise_blocker()
        if blocker is None:
            self._capture_piecewise(list(piecewise_counts))
        else:
            logger.info("prefill and mixed steps run eagerly: %s", blocker)

    def _capture_decode(self, max_model_len: int, decode_sizes: list[int], rows_per_seq: int) -> None:
        started, free_before = time.monotonic(), torch.cuda.mem_get_info()[0]
        sizes = {1: decode_sizes}
        if rows_per_seq > 1:
            sizes[rows_per_seq] = graph_batch_sizes(decode_sizes[-1], max(1, MAX_GRAPH_BATCH // rows_per_seq))
        keys = sorted(((rows, n) for rows, counts in sizes.items() for n in counts), key=lambda k: -k[0] * k[1])
        max_rows = keys[0][0] * keys[0][1]
        self._static = _StaticDecodeInputs(max_rows, -(-max_model_len // self.block_size), self.device,
                                           self._static_intermediate(max_rows))
        pool = torch.cuda.graph_pool_handle()
        logger.info("capturing %d CUDA graphs (%s requests a graph at 1 row a request%s)", len(keys),
                    f"{sizes[1][-1]} down to {sizes[1][0]}",
                    f", {sizes[rows_per_seq][-1]} down to 1 at {rows_per_seq}" if rows_per_seq > 1 else "")
        graphs = {}
        for key in keys:
            graphs[key] = self._capture(key, max_model_len, pool)
            if len(graphs) % 8 == 0:
                logger.info("captured %d of %d CUDA graphs", len(graphs), len(keys))
        torch.cuda.synchronize()
        self.graphs, self._graph_sizes = graphs, sizes
        logger.info("captured %d CUDA graphs (up to %d rows) in %.1f s using %.2f GiB", len(keys), max_rows,
                    time.monotonic() - started, (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def _piecewise_blocker(self) -> str | None:
        """Why steps that are not pure decodes cannot replay piecewise graphs here; None if they can."""
        if self.stage is not None:
            return "pipeline stages send activations between pieces"
        if get_tp().world_size > 1:
            return "tensor-parallel ranks would each replay pieces around eager attention (not measured yet)"
        for name, part in (("LoRA", self.lora), ("speculative decoding", self.drafter),
                           ("a multimodal model", self.multimodal), ("pooling", self.pooler)):
            if part is not None:
                return f"{name} sets per-step state the pieces would capture"
        return None

    def _capture_piecewise(self, counts: list[int]) -> None:
        started, free_before = time.monotonic(), torch.cuda.mem_get_info()[0]
        piecewise = PiecewiseGraphs(counts, self.device)
        try:
            # A pool of their own: one capture that fails gives all of it back.
            pool = torch.cuda.graph_pool_handle()
            piecewise.capture(self.model, self.backend, self.kv_caches, self.block_size, pool)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            # Eager steps give the same tokens: a model whose larger steps cannot be captured (a
            # host read in a code path the decode graphs never take) still serves, only slower.
            del piecewise
            torch.cuda.empty_cache()
            hint = (" (lower gpu_memory_utilization or max_num_batched_tokens)"
                    if isinstance(exc, torch.OutOfMemoryError) else "")
            logger.warning("piecewise graphs up to %d tokens were not captured (%s): prefill and mixed steps run "
                           "eagerly%s", counts[-1], str(exc).splitlines()[0] if str(exc) else type(exc).__name__, hint)
            return
        self.piecewise = piecewise
        pieces = sum(len(g.graphs) for g in piecewise.graphs.values())
        logger.info("captured piecewise graphs for %d token counts (%d to %d; %d pieces) in %.1f s using %.2f GiB",
                    len(counts), counts[0], counts[-1], pieces, time.monotonic() - started,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def _static_intermediate(self, max_batch: int) -> IntermediateTensors | None:
        if self.stage is None or self.stage.is_first:
            return None
        stage = self.stage
        return IntermediateTensors(*(torch.zeros(max_batch, stage.hidden_size, dtype=stage.dtype, device=self.device)
                                     for _ in range(stage.streams)))

    def _capture(self, key: GraphKey, max_model_len: int, pool) -> _DecodeGraph:
        static, size = self._static, key[0] * key[1]
        attn = static.attention_batch(size, max_model_len, self.block_size, rows_per_seq=key[0],
                                      ordered=self.backend.uses_decode_order(key[1], key[0], max_model_len))
        ctx = ForwardContext(self.backend, self.backend.build_metadata(attn, check_indices=False), self.kv_caches)
        args = (static.input_ids[:size], static.positions[:size], ctx)
        if self.stage is not None:
            inter = static.intermediate
            args += (None if inter is None else inter.rows(size),)
        # Once eagerly first: compiles the kernels, sets up cuBLAS outside the capture and times its
        # GEMMs' row counts against padded ones (padded_rows), which the capture then records.
        with padded_rows.tuning():
            self.model(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.model(*args)
        return _DecodeGraph(size, graph, output, attn)

    def upload(self, host: HostStep) -> StepInputs:
        key = None if self._static is None else choose_graph(self._graph_sizes, self._static.max_blocks, host)
        if key is None:
            return super().upload(host)
        # A vision-language model's step replays a graph unless it merges image rows or needs
        # M-RoPE's three position rows (`MultiModalStep.graph_positions`).
        positions = host.positions if self.multimodal is None else self.multimodal.graph_positions(host, self.states)
        if positions is None:
            return super().upload(host)
        static, graph = self._static, self.graphs[key]
        size = graph.size
        if key[0] == 1:
            # A one-token prefill chunk makes a decode-shaped row that samples nothing.
            padded, index, token_rows = pad_decode_step(host, size, positions), logits_index(host), None
        else:
            (padded, token_rows), index = pad_verify_step(host, *key, positions), None
        order = [longest_first(padded[3], key[0])] if graph.attn.decode_order is not None else []
        extra = [a for a in (index, token_rows) if a is not None]
        tensors = self.to_device([*padded, *order, *extra])
        static.load(size, tensors[:5], tensors[5] if order else None)
        rest = tensors[5 + len(order)] if extra else None
        return _GraphStepInputs(host, static.input_ids[:size], static.positions[:size], graph.attn,
                                rest if index is not None else None, graph, rest if token_rows is not None else None)

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        offsets, total = packed_layout(arrays)
        staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        pack(staging.numpy(), arrays, offsets)
        return unpack(staging.to(self.device, non_blocking=True), arrays, offsets)

    def fetch_to_host(self, tensors: list[torch.Tensor]) -> HostFetch:
        # Pinned targets make the copies asynchronous; the event marks where this step's copies
        # end in the stream, so waiting on it ignores the step launched after.
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return HostFetch(hosts, done.synchronize)

    def run_model(self, inputs: StepInputs) -> torch.Tensor | None:
        if not isinstance(inputs, _GraphStepInputs):
            bucket = None if self.piecewise is None else self.piecewise.bucket(inputs.host.num_tokens)
            if bucket is not None:
                metadata = self.backend.build_metadata(inputs.attn, check_indices=False)
                return self.piecewise.run(bucket, self.backend, metadata, inputs.input_ids, inputs.positions)
            return super().run_model(inputs)
        graph, stage = inputs.graph, self.stage
        if stage is not None:
            stage.receive(graph.size, into=self._static.intermediate)
        graph.graph.replay()
        if stage is None or stage.is_last:
            if inputs.token_rows is not None:
                return graph.output.index_select(0, inputs.token_rows)
            return graph.output[: inputs.host.num_tokens]
        stage.send(graph.output)
        return None
