"""The one-shot all-reduce over NVLink (backends/cuda/custom_allreduce.py) against NCCL on real GPUs.

Each rank process joins an NCCL group and the parallel state attaches the CUDA platform's
communicator as an engine's rank does; `corectl.distributed.all_reduce` then dispatches as in a
model. Messages around the size limit, bf16 and fp32, eager and replayed from a CUDA graph (with a
message over the limit, NCCL's, in the same graph): what the one-shot takes must equal the ranks'
values added in rank order bit for bit, on every rank, and NCCL's result within rounding (bit for
bit at two ranks, where both add once). Then a TP = 2 engine gives the same greedy tokens with the
one-shot on and off (CORECTL_CUSTOM_ALLREDUCE=0).
"""
from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from corectl import SamplingParams  # noqa: E402
from support.gpu import build_checkpoint, generate, random_prompts  # noqa: E402

GRAPH_REPLAYS = 3


def _rank_order_sum(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _same_on_every_rank(x: torch.Tensor) -> bool:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return all(torch.equal(part, parts[0]) for part in parts)


def _messages(limit: int, dtype: torch.dtype) -> list[tuple[int, bool]]:
    """(element count, whether the one-shot takes it): around the limit, and one size off the 16-byte grid."""
    from corectl.backends.cuda.custom_allreduce import ALIGNMENT

    item = torch.empty((), dtype=dtype).element_size()
    step, top = ALIGNMENT // item, limit // item
    return [(step, True), (4096, True), (top - step, True), (top, True), (top + step, False), (4095, False)]


def _check(got: torch.Tensor, inputs: torch.Tensor, taken: bool) -> list[str]:
    """What is wrong with `got`, the all-reduce of `inputs` (empty when right)."""
    failures = []
    if taken and not torch.equal(got, _rank_order_sum(inputs)):
        failures.append("differs from the rank-order sum")
    nccl = inputs.clone()
    dist.all_reduce(nccl)
    exact = dist.get_world_size() == 2
    if not (torch.equal(got, nccl) if exact else torch.allclose(got.float(), nccl.float(), rtol=2e-2, atol=5e-2)):
        failures.append("differs from NCCL")
    if not _same_on_every_rank(got):
        failures.append("differs between ranks")
    return failures


def _eager_failures(communicator, rank: int) -> list[str]:
    from corectl.distributed import all_reduce

    failures = []
    for dtype in (torch.bfloat16, torch.float32):
        for numel, taken in _messages(communicator.max_bytes, dtype):
            generator = torch.Generator(device="cuda").manual_seed(1000 * rank + numel)
            inputs = torch.randn(numel, generator=generator, device="cuda").to(dtype)
            if communicator.takes(inputs) != taken:
                failures.append(f"{dtype} x {numel}: takes() is not {taken}")
            got = all_reduce(inputs.clone())
            failures += [f"eager {dtype} x {numel}: {failure}" for failure in _check(got, inputs, taken)]
    return failures


def _graph_failures(communicator, rank: int) -> list[str]:
    """Three messages captured in one graph (two the one-shot takes, one NCCL's), replayed on new inputs."""
    from corectl.distributed import all_reduce

    sizes = [(4096, True), (communicator.max_bytes // 2, True), (communicator.max_bytes, False)]
    statics = [torch.zeros(numel, dtype=torch.bfloat16, device="cuda") for numel, _ in sizes]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm NCCL and the one-shot up outside the capture
        for static in statics:
            all_reduce(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for static in statics:
            all_reduce(static)
    failures = []
    for replay in range(GRAPH_REPLAYS):
        generator = torch.Generator(device="cuda").manual_seed(100 * replay + rank)
        inputs = [torch.randn(static.numel(), generator=generator, device="cuda").bfloat16() for static in statics]
        for static, value in zip(statics, inputs):
            static.copy_(value)
        graph.replay()
        for static, value, (numel, taken) in zip(statics, inputs, sizes):
            failures += [f"graph replay {replay}, bf16 x {numel}: {failure}"
                         for failure in _check(static, value, taken)]
    return failures


def _failures(communicator, rank: int) -> list[str]:
    if communicator is None:
        return ["no communicator attached"]
    return _eager_failures(communicator, rank) + _graph_failures(communicator, rank)


def _rank(rank: int, world_size: int, init_file: str, queue) -> None:
    from corectl.backends.cuda.platform import CUDAPlatform
    from corectl.distributed import (attach_device_communicator, destroy_parallel_state, init_parallel_state,
                                     parallel_state)

    platform = CUDAPlatform()
    platform.device_for_rank(rank)
    init_parallel_state(rank, world_size, 1, "nccl", f"file://{init_file}")
    try:
        attach_device_communicator(platform)
        failures = _failures(parallel_state._communicator, rank)
        torch.cuda.synchronize()
    finally:
        destroy_parallel_state()
    queue.put((rank, failures))


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "tp4"])
def test_one_shot_sums_equal_the_rank_order_sum_eager_and_in_graphs(world_size, tmp_path):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, world_size, str(tmp_path / "init"), queue))
             for r in range(world_size)]
    for process in ranks:
        process.start()
    reports = dict(queue.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert reports == {rank: [] for rank in range(world_size)}


def test_tp2_gives_the_same_tokens_with_the_one_shot_on_and_off(tmp_path, monkeypatch, capfd):
    checkpoint = build_checkpoint("llama", tmp_path / "llama")
    prompts = random_prompts((5, 17, 64, 130, 600), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    capfd.readouterr()
    on = generate(checkpoint, prompts, params, tensor_parallel_size=2)
    assert "NCCL for every size" not in capfd.readouterr().err  # the one-shot was attached
    monkeypatch.setenv("CORECTL_CUSTOM_ALLREDUCE", "0")
    off = generate(checkpoint, prompts, params, tensor_parallel_size=2)
    # Two ranks: the one-shot and NCCL both add the two partial sums once, so the logits are the same bits.
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
