"""The tensor-parallel all-reduce alone: NCCL against the one-shot over NVLink
(backends/cuda/custom_allreduce.py), bf16 messages of 8 KiB to 4 MiB, eager and replayed from a CUDA
graph, at each group size the host's GPUs allow (2 and 4 by default). Prints microseconds per
all-reduce; the size where the one-shot stops winning in graphs is where its limit
(`MAX_BYTES_BY_WORLD_SIZE`) belongs.

    python benchmarks/allreduce_bench.py [--world-sizes 2 4] [--iters 200]
(device_bench.sh stage `sweep:allreduce`.)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [8 << 10 << shift for shift in range(10)]  # 8 KiB .. 4 MiB
OPS_PER_GRAPH = 32


def _per_op_us(run, iters: int) -> float:
    """Microseconds per call of `run` over `iters` calls, the ranks started together."""
    run()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _graphed(op, x: torch.Tensor):
    """A replay of `OPS_PER_GRAPH` calls of `op(x)` captured in one graph (what a decode step does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(OPS_PER_GRAPH):
            op(x)
    return graph


def _measure(communicator, nbytes: int, iters: int) -> tuple[float, ...]:
    x = torch.randn(nbytes // 2, device="cuda").bfloat16()
    nccl, ours = x.clone(), x.clone()
    dist.all_reduce(nccl)
    communicator.all_reduce_(ours)
    error = (nccl.float() - ours.float()).abs().max().item()
    # The timed calls sum x into itself until it overflows: the time of a sum does not depend on its values.
    timings = [_per_op_us(lambda: dist.all_reduce(x), iters), _per_op_us(lambda: communicator.all_reduce_(x), iters)]
    for op in (dist.all_reduce, communicator.all_reduce_):
        graph = _graphed(op, x)
        timings.append(_per_op_us(graph.replay, max(1, iters // OPS_PER_GRAPH)) / OPS_PER_GRAPH)
    return (*timings, error)


def _rank(rank: int, world_size: int, init_file: str, iters: int) -> None:
    from corectl.backends.cuda.custom_allreduce import create_communicator
    from corectl.distributed import TensorParallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    communicator = create_communicator(TensorParallel(rank, world_size), max_bytes=max(SIZES))
    if communicator is None:
        raise SystemExit("the one-shot all-reduce is not available here (see the warning above)")
    rows = [(nbytes, *_measure(communicator, nbytes, iters)) for nbytes in SIZES]
    if rank == 0:
        print(f"\n{world_size} ranks, {torch.cuda.get_device_name()}, bf16, us per all-reduce "
              f"(graph: {OPS_PER_GRAPH} in one graph, per call)")
        print(f"{'KiB':>6} {'NCCL eager':>11} {'1shot eager':>12} {'NCCL graph':>11} {'1shot graph':>12} "
              f"{'graph gain':>10} {'max |diff|':>10}")
        for nbytes, nccl_eager, ours_eager, nccl_graph, ours_graph, error in rows:
            print(f"{nbytes >> 10:>6} {nccl_eager:>11.2f} {ours_eager:>12.2f} {nccl_graph:>11.2f} {ours_graph:>12.2f} "
                  f"{nccl_graph / ours_graph:>9.2f}x {error:>10.2e}")
    dist.barrier()
    del communicator
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    for world_size in args.world_sizes:
        if world_size > torch.cuda.device_count():
            print(f"{world_size} ranks: skipped, {torch.cuda.device_count()} GPUs here")
            continue
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_rank, args=(world_size, f"{folder}/init", args.iters), nprocs=world_size)


if __name__ == "__main__":
    main()
