"""The MLA decode case of `corectl bench kernels`: paged latent attention (absorbed DeepSeek MLA) at
batch 64 x context 4096, DeepSeek-V2-Lite's shape (16 heads, latent 512, rope 64), bf16.

Bandwidth counts the bytes that must move: every context's latent rows read once (576 numbers a
token, shared by all heads), the latent queries read and the latent outputs written; it is
compared with a device-to-device copy of the latent bytes measured in each pass. The sweep times
the split counts and tile configurations around the default, so a better launch shows itself, and
first prints each launch's registers, shared memory and programs per SM (how many waves its grid
takes). Earlier calls timed each launch once with `do_bench` (host launches between L2 flushes)
and saw the same launch move by up to 20 points of copy bandwidth between calls and list
positions; now every launch runs from a CUDA graph (no host time, as the engine's decode graphs),
alternating between two batches of the same shape (neither finds the other's rows in L2), in
PASSES passes of alternating orders, each pass against its own copy; the table gives the median
and every pass's share of copy bandwidth. Prefill (4 prompts of 2048 tokens, causal) is timed in
TFLOP/s of the absorbed form's products, for the rows per program.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from ..attention.latent_attention import LatentConfig


@dataclass(frozen=True)
class LatentShapes:
    num_seqs: int
    context: int
    num_heads: int
    rank: int
    rope: int
    block_size: int


V2_LITE = LatentShapes(num_seqs=64, context=4096, num_heads=16, rank=512, rope=64, block_size=16)
SMALL = LatentShapes(num_seqs=3, context=37, num_heads=5, rank=32, rope=16, block_size=4)
PREFILL_PROMPTS = (4, 2048)
# (heads per program, keys per tile, warps, stages) tried beside the default launch.
SWEEP = ((16, 32, 8, 2), (16, 32, 4, 3), (16, 32, 8, 3), (16, 64, 8, 2), (16, 16, 4, 2), (16, 16, 4, 3))
# Each launch is timed PASSES times in alternating orders (module doc), from a CUDA graph of
# GRAPH_PAIRS launch pairs replayed REPLAYS times.
PASSES, GRAPH_PAIRS, REPLAYS = 4, 20, 10


def _latent_batch(s: LatentShapes, seq_lens: list[int], dtype: torch.dtype, device: str):
    """(batch, its one-part cache view, q [B, H, rank + rope]) of random contexts in shuffled blocks."""
    from .paged_batch import random_paged_batch

    batch = random_paged_batch(seq_lens, [1] * len(seq_lens), s.num_heads, 1, s.rank + s.rope, s.block_size, dtype,
                               device, store_new_tokens=True, spare_blocks=0)
    return batch, batch.kv_cache[:1], batch.q.view(len(seq_lens), s.num_heads, s.rank + s.rope)


def check_latent(s: LatentShapes, device: str, dtype: torch.dtype) -> list[tuple[str, float]]:
    """Relative error of the decode kernel, unsplit and split, against the causal torch reference."""
    from ..attention.latent_attention import paged_latent_attention
    from ..reference import causal_attention_ref
    from .measure import rel_error

    scale = (s.rank + s.rope) ** -0.5
    seq_lens = [s.context - 7 * i for i in range(s.num_seqs)]
    batch, cache, q = _latent_batch(s, seq_lens, dtype, device)
    expected = torch.cat([causal_attention_ref(q[i:i + 1], keys, keys[..., :s.rank], scale)
                          for i, keys in enumerate(batch.keys)])
    results = []
    for splits in (1, 4):
        out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, scale, rank=s.rank,
                                     max_seq_len=max(seq_lens), num_splits=splits)
        results.append((f"MLA decode, {splits} split(s)", rel_error(out, expected)))
    return results


def bench_latent(s: LatentShapes, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    """(name, median ms, TB/s): the copy ceiling over the latent bytes, then each decode launch, the
    medians of PASSES passes in alternating orders, each name listing its passes (% of that pass's
    copy); each launch's resources are printed as it compiles."""
    from ..attention.decode_attention import choose_decode_splits

    pair = [_latent_batch(s, [s.context] * s.num_seqs, dtype, "cuda") for _ in range(2)]
    q = pair[0][2]
    elem = q.element_size()
    latent_bytes = s.num_seqs * s.context * (s.rank + s.rope) * elem
    moved = latent_bytes + q.numel() * elem + s.num_seqs * s.num_heads * s.rank * elem
    auto = choose_decode_splits(s.num_seqs, 1, s.context, q.device)
    launches = [(splits, LatentConfig()) for splits in sorted({2, 4, 8, 16, auto})]
    launches += [(auto, LatentConfig(*cfg)) for cfg in SWEEP if LatentConfig(*cfg) != LatentConfig()]
    copy = _graph_copy(latent_bytes)
    print(f"\nMLA decode launches at {s.num_seqs} x {s.context} (registers, shared memory, programs an SM holds):")
    runs = {}
    for splits, cfg in launches:
        label = (f"MLA decode, {splits} split(s){' [auto]' if splits == auto else ''}, "
                 f"h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}")
        try:
            compiled, runs[label] = _launch_pair(s, pair, splits, cfg)
        except OutOfResources as error:  # a tile that does not fit the SM
            print(f"  {label}: {error}")
            continue
        print(f"  {label}: {_occupancy(compiled, s.num_seqs * splits)}")
    runs[f"MLA decode, {auto} split(s), default, by do_bench (as before)"] = _eager(s, pair[0])
    copies, times, shares = [], {label: [] for label in runs}, {label: [] for label in runs}
    labels = list(runs)
    for number in range(PASSES):
        # Forward, reversed, then both from the middle: no launch keeps its place in the list.
        order = labels[::-1] if number % 2 else labels
        order = order[len(order) // 2:] + order[:len(order) // 2] if number >= 2 else order
        copies.append(copy())
        for label in order:
            times[label].append(runs[label]())
            shares[label].append(100 * moved / times[label][-1] / (2 * latent_bytes / copies[-1]))
    copy_ms = statistics.median(copies)
    passes = " ".join(f"{2 * latent_bytes / ms / 1e9:.2f}" for ms in copies)  # bytes a ms / 1e9: TB/s
    rows = [(f"copy (read + write), median; passes {passes} TB/s", copy_ms, 2 * latent_bytes / copy_ms / 1e9)]
    for label, values in times.items():
        passes = " ".join(f"{share:.0f}" for share in shares[label])
        rows.append((f"{label}; passes {passes}%", statistics.median(values), moved / statistics.median(values) / 1e9))
    return rows


def _eager(s: LatentShapes, batch_cache_q):
    """A function timing the default launch as earlier calls did: `do_bench` (an L2 flush before
    each launch, launched from the host), for comparison with the graph timings."""
    from triton.testing import do_bench

    from ..attention.latent_attention import paged_latent_attention

    batch, cache, q = batch_cache_q

    def decode():
        paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, (s.rank + s.rope) ** -0.5,
                               rank=s.rank, max_seq_len=s.context, check_indices=False)

    return lambda: do_bench(decode, warmup=50, rep=300, return_mode="median")


def _launch_pair(s: LatentShapes, pair, splits: int, cfg: LatentConfig):
    """(compiled kernel, a function timing ms a launch) of launch pairs, one launch over each batch of
    `pair` (so neither finds the other's rows in L2), from a CUDA graph of GRAPH_PAIRS pairs: no host
    in the timing, as in the engine's decode graphs."""
    from ..attention.latent_attention import launch_latent

    scale = (s.rank + s.rope) ** -0.5
    outs = [torch.empty(s.num_seqs, s.num_heads, s.rank, dtype=q.dtype, device=q.device) for _, _, q in pair]
    tickets = torch.zeros(s.num_seqs * s.num_heads, dtype=torch.int32, device=pair[0][2].device)

    def launch():
        return [launch_latent(q, cache, batch.block_tables, batch.seq_lens, None, out, scale, s.rank, splits, cfg,
                              tickets) for (batch, cache, q), out in zip(pair, outs)][-1]

    compiled = launch()
    return compiled, _GraphTimer(_capture(launch, GRAPH_PAIRS), 2 * GRAPH_PAIRS, (outs, tickets))


def _capture(fn, times: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(times):
                fn()
    torch.cuda.synchronize()
    return graph


class _GraphTimer:
    """ms a call, from replays of a graph of `calls` calls. It holds the tensors the graph writes and
    reads that nothing else holds (outputs, tickets, copy buffers): a graph keeps raw addresses, and
    replaying it after they were freed wrote into reused or released memory (an illegal access)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, calls: int, tensors: tuple):
        self.graph, self.calls, self.tensors = graph, calls, tensors

    def __call__(self) -> float:
        return _replay_ms(self.graph) / self.calls


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """The median of REPLAYS replays' wall time on the device, after one warm replay."""
    graph.replay()
    results = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end))
    return statistics.median(results)


def _graph_copy(nbytes: int):
    """A function timing a device-to-device copy of `nbytes` (ms a copy) from a CUDA graph."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _GraphTimer(_capture(lambda: dst.copy_(src), GRAPH_PAIRS), GRAPH_PAIRS, (src, dst))


def _occupancy(compiled, programs: int) -> str:
    """Registers, spills and shared memory of a compiled launch, and how many of its programs an SM
    holds at once by each (the least binds): too few programs per SM leave bandwidth unused."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    regs, spills = getattr(compiled, "n_regs", 0), getattr(compiled, "n_spills", 0)
    shared, warps = compiled.metadata.shared, compiled.metadata.num_warps
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs * 32 * warps)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // max(1, shared + 1024)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    held = min(by_regs, by_smem, by_threads, 32)
    slots = held * props.multi_processor_count
    return (f"{regs} registers, {spills} spilled, {shared // 1024} KiB shared -> {held} per SM (by registers "
            f"{by_regs}, shared {by_smem}, threads {by_threads}); {programs} programs in {slots} slots, "
            f"{-(-programs // max(1, slots))} wave(s)")


def bench_latent_prefill(s: LatentShapes, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    """(name, median ms, TFLOP/s) of causal prefills of PREFILL_PROMPTS over an empty prefix."""
    from triton.testing import do_bench

    from ..attention.latent_attention import PREFILL, paged_latent_attention
    from .paged_batch import random_paged_batch

    count, length = PREFILL_PROMPTS
    width = s.rank + s.rope
    batch = random_paged_batch([length] * count, [length] * count, s.num_heads, 1, width, s.block_size, dtype,
                               "cuda", store_new_tokens=True, spare_blocks=0)
    q = batch.q.view(-1, s.num_heads, width)
    # Each query of position p meets p + 1 keys: a score (width) and an output (rank) product per head.
    flops = 2 * count * length * (length + 1) // 2 * s.num_heads * (width + s.rank)
    rows = []
    for cfg in (PREFILL, PREFILL._replace(rows=32), PREFILL._replace(rows=16, num_warps=4)):
        def prefill(cfg=cfg):
            paged_latent_attention(q, batch.kv_cache[:1], batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                   width ** -0.5, rank=s.rank, max_seq_len=length, check_indices=False, config=cfg)

        ms = do_bench(prefill, warmup=10, rep=100, return_mode="median")
        rows.append((f"MLA prefill {count} x {length}, rows {cfg.rows} w{cfg.num_warps}", ms, flops / ms / 1e9))
    return rows
