"""The CUDA/ROCm platform pieces that need no GPU: detection, graph buckets and padding, the packed
upload layout, and the host step arrays that graph replays are built from."""
from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from corectl.attention import longest_first
from corectl.backends.cuda import platform as cuda_platform
from corectl.backends.cuda.graph_runner import (
    MAX_GRAPH_BATCH,
    CUDAGraphModelRunner,
    _DecodeGraph,
    _StaticDecodeInputs,
    choose_graph,
    graph_batch_sizes,
    graph_bucket,
    pack,
    packed_layout,
    pad_decode_step,
    pad_verify_step,
    unpack,
)
from corectl.backends.rocm import platform as rocm_platform
from corectl.platform import PlatformCaps
from corectl.worker.model_runner import ModelRunner
from corectl.worker.request_states import RequestStates
from support.scheduling import new_request_data, scheduler_output

BS = 4


# -- platform detection ------------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend torch sees a GPU; returns a setter for the HIP version and device properties."""
    for cached in (cuda_platform._device_capability, rocm_platform._gcn_arch):
        cached.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def configure(hip=None, capability=(9, 0), arch="gfx942:sramecc+:xnack-"):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(gcnArchName=arch))

    yield configure
    for cached in (cuda_platform._device_capability, rocm_platform._gcn_arch):
        cached.cache_clear()


def test_cuda_platform_reads_capabilities_from_the_device(fake_gpu):
    fake_gpu(capability=(9, 0))
    assert cuda_platform.CUDAPlatform.is_available()
    assert not rocm_platform.ROCmPlatform.is_available()
    caps = cuda_platform.CUDAPlatform().capabilities()
    assert caps.default_dtype == "bfloat16" and caps.pinned_memory and caps.async_output
    assert caps.sampling_draw == "exponential_race"


def test_pre_ampere_gpu_has_no_bf16(fake_gpu):
    fake_gpu(capability=(7, 5))
    caps = cuda_platform.CUDAPlatform().capabilities()
    assert caps.dtypes == ("float16", "float32") and caps.default_dtype == "float16"


@pytest.mark.parametrize("capability, kernels", [
    ((9, 0), ("fp8_scaled_mm", "w4a16", "w8a16", "fp8_block_w8a16", "mxfp4_moe")),
    ((8, 9), ("fp8_scaled_mm", "w4a16", "w8a16", "fp8_block_w8a16", "mxfp4_moe")),
    ((8, 0), ("w4a16", "w8a16", "fp8_block_w8a16", "mxfp4_moe")),
])
def test_fp8_kernels_from_ada_and_hopper_on(fake_gpu, capability, kernels):
    fake_gpu(capability=capability)
    assert cuda_platform.CUDAPlatform().capabilities().quantization_kernels == kernels


def test_hip_build_is_rocm_not_cuda(fake_gpu):
    fake_gpu(hip="6.2.0", arch="gfx942:sramecc+:xnack-")
    assert not cuda_platform.CUDAPlatform.is_available()
    assert rocm_platform.ROCmPlatform.is_available()
    caps = rocm_platform.ROCmPlatform().capabilities()
    assert caps.default_dtype == "bfloat16" and caps.pinned_memory
    assert caps.quantization_kernels == ("w4a16", "w8a16")


@pytest.mark.parametrize("arch, bf16", [("gfx90a", True), ("gfx1100", True), ("gfx950", True), ("gfx1030", False)])
def test_rocm_features_by_gfx_arch(arch, bf16):
    caps = rocm_platform.rocm_caps(arch)
    assert ("bfloat16" in caps.dtypes) == bf16


@pytest.mark.parametrize("hip", [None, "6.2.0"])
def test_no_gpu_means_neither_platform(hip, monkeypatch, fake_gpu):
    fake_gpu(hip=hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cuda_platform.CUDAPlatform.is_available()
    assert not rocm_platform.ROCmPlatform.is_available()


def test_broken_driver_reads_as_unavailable(monkeypatch, fake_gpu):
    fake_gpu()

    def broken(device=None):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert not cuda_platform.CUDAPlatform.is_available()


def test_cuda_worker_imports_without_a_gpu():
    from corectl.backends.cuda.graph_runner import CUDAGraphModelRunner
    from corectl.backends.cuda.worker import CUDAWorker

    assert CUDAWorker.runner_cls is CUDAGraphModelRunner
    assert rocm_platform.ROCmPlatform().worker_cls() is CUDAWorker


# -- graph buckets ---------------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (10, [1, 2, 4, 8, 10]), (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_graph_batch_sizes(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def test_graph_batch_sizes_pad_by_fewer_than_eight_rows_up_to_the_limit():
    sizes = graph_batch_sizes(10_000)
    assert sizes[-1] == MAX_GRAPH_BATCH and sizes == sorted(set(sizes))
    assert all(graph_bucket(sizes, n) - n < 8 for n in range(1, MAX_GRAPH_BATCH + 1))
    assert graph_bucket(sizes, MAX_GRAPH_BATCH + 1) is None


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (24, 24), (25, 32), (33, None)])
def test_graph_bucket_is_the_smallest_that_fits(num_seqs, bucket):
    assert graph_bucket([1, 2, 4, 8, 16, 24, 32], num_seqs) == bucket


# -- host steps -------------------------------------------------------------------------------

def test_a_mixed_step_replays_no_graph():
    states = RequestStates(torch.device("cpu"))
    sched = scheduler_output(new=[new_request_data("cold", range(100, 106), [3, 9]),
                                  new_request_data("dec", range(300, 310), [2, 8, 11], computed=9, prompt=7)],
                             scheduled={"cold": 6, "dec": 1})
    states.apply(sched)
    host = states.build_step(sched, BS)
    assert not host.samples_every_row and choose_graph({1: [1, 2, 4]}, 8, host) is None


def _decode_states(num_seqs, context=9):
    states = RequestStates(torch.device("cpu"))
    new = [new_request_data(f"r{i}", range(i, i + context + i), list(range(10 * i + 1, 10 * i + 4)), computed=context + i - 1)
           for i in range(num_seqs)]
    sched = scheduler_output(new=new, scheduled={n.req_id: 1 for n in new})
    states.apply(sched)
    return states, sched


def test_decode_step_is_graphable_and_pads_with_inert_rows():
    states, sched = _decode_states(3)
    host = states.build_step(sched, BS)
    assert host.samples_every_row and host.block_tables.shape == (3, 3)
    assert choose_graph({1: [1, 2, 4, 8]}, 3, host) == (1, 4)
    assert choose_graph({1: [1, 2], 5: [1, 2, 4]}, 3, host) is None
    assert choose_graph({1: [1, 2, 4, 8]}, 2, host) is None      # wider than the captured block tables
    input_ids, positions, slots, seq_lens, tables = pad_decode_step(host, 4)
    assert input_ids.tolist() == host.input_ids.tolist() + [0]
    assert positions.tolist() == host.positions.tolist() + [0]
    assert slots.tolist() == host.slot_mapping.tolist() + [-1]
    assert seq_lens.tolist() == [9, 10, 11, 0]
    assert tables.tolist() == host.block_tables.tolist() + [[0, 0, 0]]


# -- packed uploads and the static graph inputs ---------------------------------------------------

def test_packed_arrays_come_back_with_their_dtypes_and_shapes():
    arrays = [np.arange(3, dtype=np.int64), np.arange(5, dtype=np.int32), np.arange(6, dtype=np.int32).reshape(2, 3),
              np.array([-1, 7], dtype=np.int64)]
    offsets, total = packed_layout(arrays)
    assert all(offset % 16 == 0 for offset in offsets) and total >= sum(a.nbytes for a in arrays)
    buffer = torch.zeros(total, dtype=torch.uint8)
    pack(buffer.numpy(), arrays, offsets)
    for array, tensor in zip(arrays, unpack(buffer, arrays, offsets)):
        assert tensor.dtype == torch.from_numpy(array).dtype and np.array_equal(tensor.numpy(), array)


def test_static_inputs_take_each_step_whole_whatever_the_previous_step_left():
    static = _StaticDecodeInputs(max_batch=8, max_blocks=6, device=torch.device("cpu"))
    for num_seqs in (4, 3):
        states, sched = _decode_states(num_seqs)
        host = states.build_step(sched, BS)
        static.load(4, [torch.from_numpy(a) for a in pad_decode_step(host, 4)])
    assert static.seq_lens[:4].tolist() == [9, 10, 11, 0]
    assert static.slot_mapping[:4].tolist() == host.slot_mapping.tolist() + [-1]
    assert static.block_tables[:3, :3].tolist() == host.block_tables.tolist()
    assert static.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    batch = static.attention_batch(4, max_model_len=24, block_size=BS)
    assert batch.block_tables.shape == (4, 6) and batch.max_seq_len == 24 and batch.is_pure_decode


def _eager_and_graph_attention(host, size, num_splits=None, rows_per_seq=1):
    """The Triton backend's output and KV cache for a step run eagerly and as the graph sees it
    (padded to `size` decode rows, `rows_per_seq` a request, stale block-table columns, the split
    count chosen for the model's max length, or `num_splits`)."""
    from corectl.backends.triton.attention.backend import TritonAttentionBackend

    heads, kv_heads, head_dim, max_model_len = 4, 2, 16, 48
    backend = TritonAttentionBackend(heads, kv_heads, head_dim, torch.float32, torch.device("cpu"), BS)
    kv_cache = torch.randn(backend.kv_cache_shape(40, BS, kv_heads, head_dim))
    q = torch.randn(size, heads * head_dim)
    k, v = torch.randn(size, kv_heads * head_dim), torch.randn(size, kv_heads * head_dim)
    n = host.num_tokens
    eager_cache = kv_cache.clone()
    eager = backend.forward(q[:n], k[:n], v[:n], eager_cache, backend.build_metadata(_eager_batch(host)), 0.25)
    static = _StaticDecodeInputs(max_batch=16, max_blocks=max_model_len // BS, device=torch.device("cpu"))
    static.block_tables.fill_(39)   # stale ids from earlier, wider steps
    token_rows = torch.arange(size)
    if rows_per_seq == 1:
        padded = pad_decode_step(host, size)
    else:
        padded, rows = pad_verify_step(host, rows_per_seq, size // rows_per_seq)
        token_rows = torch.from_numpy(rows)
        q, k, v = (torch.zeros_like(t).index_copy_(0, token_rows, t[:n]) for t in (q, k, v))
    order = torch.from_numpy(longest_first(padded[3], rows_per_seq))
    static.load(size, [torch.from_numpy(a) for a in padded], order)
    batch = static.attention_batch(size, max_model_len, BS, rows_per_seq, ordered=True)
    meta = backend.build_metadata(batch, check_indices=False)
    assert meta.decode_order is batch.decode_order and meta.decode_order.shape == (size // rows_per_seq,)
    if num_splits is not None:
        meta.num_splits = num_splits
    graph_cache = kv_cache.clone()
    out = backend.forward(q, k, v, graph_cache, meta, 0.25)
    # Rows in token order, then the padding rows.
    order = torch.cat([token_rows, torch.tensor([r for r in range(size) if r not in set(token_rows.tolist())], dtype=torch.long)])
    return eager, eager_cache, out[order], graph_cache


def test_padded_decode_through_the_triton_backend_matches_the_unpadded_step():
    """The graph's view of a step attends and stores exactly as the eager step does."""
    states, sched = _decode_states(3)
    eager, eager_cache, padded, graph_cache = _eager_and_graph_attention(states.build_step(sched, BS), 4, 3)
    torch.testing.assert_close(padded[:3], eager, rtol=2e-5, atol=2e-5)
    assert torch.equal(padded[3], torch.zeros_like(padded[3]))
    assert torch.equal(graph_cache, eager_cache)


def _eager_batch(host):
    from corectl.attention import AttentionBatch

    return AttentionBatch(
        query_start_loc=torch.from_numpy(host.query_start_loc), seq_lens=torch.from_numpy(host.seq_lens),
        block_tables=torch.from_numpy(host.block_tables), slot_mapping=torch.from_numpy(host.slot_mapping),
        query_lens_host=host.query_lens, seq_lens_host=host.seq_lens_list, max_query_len=host.max_query_len,
        max_seq_len=host.max_seq_len, block_size=BS,
    )


def test_graph_step_uploads_into_the_static_inputs_and_samples_only_finished_rows(monkeypatch):
    """A one-token prefill chunk is decode-shaped, so it rides a graph, but it samples nothing."""
    from corectl.backends.triton.attention.backend import TritonAttentionBackend

    cpu = torch.device("cpu")
    backend = TritonAttentionBackend(4, 2, 16, torch.float32, cpu, BS)
    runner = CUDAGraphModelRunner(None, backend, cpu, BS, 1000, None, PlatformCaps())
    monkeypatch.setattr(runner, "to_device", lambda arrays: ModelRunner.to_device(runner, arrays))
    static = _StaticDecodeInputs(max_batch=8, max_blocks=6, device=cpu)
    runner._static, runner._graph_sizes = static, {1: [1, 2, 4, 8]}
    runner.graphs = {(1, size): _DecodeGraph(size, None, torch.zeros(size, 1),
                                             static.attention_batch(size, 24, BS, ordered=True))
                     for size in runner._graph_sizes[1]}
    sched = scheduler_output(new=[new_request_data("a", range(9), [1, 2, 3], computed=8), new_request_data("chunk", range(20), [4, 5], computed=4),
                       new_request_data("b", range(6), [6, 7], computed=5)],
                  scheduled={"a": 1, "chunk": 1, "b": 1})
    runner.states.apply(sched)
    inputs = runner.upload(runner.states.build_step(sched, BS))
    assert inputs.graph.size == 4 and inputs.input_ids.data_ptr() == static.input_ids.data_ptr()
    assert inputs.logits_indices.tolist() == [0, 2]
    assert static.input_ids[:4].tolist() == [8, 4, 5, 0] and static.seq_lens[:4].tolist() == [9, 5, 6, 0]
    assert static.slot_mapping[:4].tolist() == [3 * BS, 5 * BS, 7 * BS + 1, -1]
    # The rows longest context first, the padding row last: the graph's attention walks them so.
    assert static.decode_order[:4].tolist() == [0, 2, 1, 3]
    assert inputs.attn.decode_order.data_ptr() == static.decode_order.data_ptr()


# -- verify steps (speculative decoding) as decode rows -------------------------------------------

def _verify_step(num_drafts=(2, 3)):
    """Requests decoding their newest token (context 9, 10, ...) with `num_drafts` drafts each."""
    states = RequestStates(torch.device("cpu"))
    new = [new_request_data(f"v{i}", range(i, i + 9 + i), list(range(10 * i + 1, 10 * i + 5)), computed=8 + i)
           for i in range(len(num_drafts))]
    drafts = {n.req_id: [50 + j for j in range(d)] for n, d in zip(new, num_drafts)}
    sched = scheduler_output(new=new, scheduled={n.req_id: 1 + d for n, d in zip(new, num_drafts)})
    sched = msgspec.structs.replace(sched, spec_token_ids=drafts)
    states.apply(sched)
    return states.build_step(sched, BS)


def test_a_verify_step_replays_k_plus_one_rows_a_request_when_asked():
    host = _verify_step()
    assert host.verifies and host.samples_every_row and host.num_tokens == 7
    assert choose_graph({1: [1, 2, 4, 8]}, 4, host) is None                 # verify graphs off
    assert choose_graph({1: [1, 2, 4, 8], 4: [1, 2, 4]}, 4, host) == (4, 2)
    assert choose_graph({1: [1, 2, 4, 8], 4: [1]}, 4, host) is None         # more requests than the largest bucket
    assert choose_graph({1: [1, 2, 4, 8], 3: [1, 2, 4]}, 4, host) is None   # 4 rows of a request do not fit 3
    (input_ids, positions, slots, seq_lens, tables), token_rows = pad_verify_step(host, 4, 4)
    assert token_rows.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert input_ids[token_rows].tolist() == host.input_ids.tolist() and input_ids[[3, 8]].tolist() == [0, 0]
    assert positions.tolist() == [8, 9, 10, 0, 9, 10, 11, 12] + [0] * 8
    # Row j of a request ends at its own position: causal within the request; padding attends to nothing.
    assert seq_lens.tolist() == [9, 10, 11, 0, 10, 11, 12, 13] + [0] * 8
    assert tables.tolist() == [host.block_tables[0].tolist()] * 4 + [host.block_tables[1].tolist()] * 4 + [[0] * 4] * 8
    assert slots[token_rows].tolist() == host.slot_mapping.tolist() and slots[[3, 8, 15]].tolist() == [-1] * 3


def test_a_mixed_step_with_drafts_replays_no_graph():
    states = RequestStates(torch.device("cpu"))
    sched = scheduler_output(new=[new_request_data("cold", range(100, 106), [3, 9]),
                                  new_request_data("dec", range(300, 310), [2, 8, 11], computed=9, prompt=7)],
                             scheduled={"cold": 6, "dec": 3})
    sched = msgspec.structs.replace(sched, spec_token_ids={"dec": [5, 6]})
    states.apply(sched)
    assert choose_graph({1: [1, 2, 4, 8, 16], 3: [1, 2, 4]}, 8, states.build_step(sched, BS)) is None


def test_verify_rows_through_the_triton_backend_match_the_eager_verify_step():
    """The graph's view of a verify step (4 rows a request, padding after a request's tokens and
    a padding group) attends and stores exactly as the eager extend step does: each request's
    rows causally, one group's K/V read once for its rows, whole or split."""
    for splits in (1, 3):
        eager, eager_cache, rows, graph_cache = _eager_and_graph_attention(_verify_step(), 12, splits, 4)
        torch.testing.assert_close(rows[:7], eager, rtol=2e-5, atol=2e-5)
        assert torch.equal(rows[-4:], torch.zeros_like(rows[-4:]))
        assert torch.equal(graph_cache, eager_cache)


def test_a_verify_graph_step_comes_back_in_token_order(monkeypatch):
    """A verify step uploads into the k + 1-rows-a-request layout, and the replayed graph's rows
    come back as the step's tokens, in order, without the padding rows."""
    from corectl.backends.triton.attention.backend import TritonAttentionBackend

    cpu = torch.device("cpu")
    backend = TritonAttentionBackend(4, 2, 16, torch.float32, cpu, BS)
    runner = CUDAGraphModelRunner(None, backend, cpu, BS, 1000, None, PlatformCaps())
    monkeypatch.setattr(runner, "to_device", lambda arrays: ModelRunner.to_device(runner, arrays))
    static = _StaticDecodeInputs(max_batch=16, max_blocks=6, device=cpu)
    runner._static, runner._graph_sizes = static, {1: [1, 2], 4: [1, 2]}
    replayed = []
    runner.graphs = {(rows, n): _DecodeGraph(rows * n, SimpleNamespace(replay=lambda key=(rows, n): replayed.append(key)),
                                             torch.arange(rows * n, dtype=torch.float32)[:, None],
                                             static.attention_batch(rows * n, 24, BS, rows))
                     for rows, counts in runner._graph_sizes.items() for n in counts}
    inputs = runner.upload(_verify_step())
    assert inputs.graph.size == 8 and inputs.logits_indices is None
    assert inputs.attn.rows_per_seq == 4 and static.seq_lens[:8].tolist() == [9, 10, 11, 0, 10, 11, 12, 13]
    hidden = runner.run_model(inputs)
    assert replayed == [(4, 2)] and hidden[:, 0].tolist() == [0, 1, 2, 4, 5, 6, 7]
