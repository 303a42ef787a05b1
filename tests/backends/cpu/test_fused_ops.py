"""The CPU's fused C kernels (backends/cpu/fused_ops.c) against the torch expressions they replace:
rotary bitwise, RMSNorm's residual sum bitwise and its norm within a few ulps, SiLU * up within an ulp,
the paged attention against the torch SDPA path; every kernel's rows alone equal the same rows in a
batch. Then a whole layer as one C call (fused_layer.py) on a tiny 4-bit GGUF Llama: the same logprobs,
bit for bit, as the per-operator kernels, and the greedy tokens of the torch layer code."""
from __future__ import annotations

import dataclasses
import platform

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.attention import AttentionBatch
from corectl.backends.cpu import fused_layer, fused_ops
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.models.kernels import install_layer_kernels
from gguf import GGMLQuantizationType as Q
from support.close import assert_close
from support.gguf_files import write_gguf
from support.models import build_random_checkpoint
from support.quant_checkpoints import random_prompts

pytestmark = pytest.mark.skipif(fused_ops.fused_library() is None, reason="no C compiler to build the kernels")


def _rows_alone_equal_batched(fn, *batched_inputs):
    whole = fn(*batched_inputs)
    for i in (0, batched_inputs[0].shape[0] - 1):
        assert torch.equal(fn(*(x[i:i + 1].clone() for x in batched_inputs)), whole[i:i + 1])
    return whole


def test_rms_norm_matches_torch_and_its_rows_stand_alone():
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 200, generator=g), torch.randn(5, 200, generator=g)
    weight = torch.randn(200, generator=g)
    summed = x + residual
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    out, got_sum = fused_ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(got_sum, summed)
    assert_close(out, expected, 1e-6, norm="max")
    _rows_alone_equal_batched(lambda a, b: fused_ops.rms_norm(a, weight, 1e-5, b)[0], x, residual)
    assert torch.equal(fused_ops.rms_norm(summed, weight, 1e-5), out)


def test_silu_and_mul_matches_torch():
    x = torch.randn(4, 2 * 72, generator=torch.Generator().manual_seed(1)) * 4
    expected = torch.nn.functional.silu(x[:, :72]) * x[:, 72:]
    assert_close(_rows_alone_equal_batched(fused_ops.silu_and_mul, x), expected, 1e-6, norm="max")


@pytest.mark.parametrize("head_stride", [16, 24], ids=["heads-adjacent", "mla-strided-heads"])
def test_rotary_is_torchs_bitwise_in_place(head_stride):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 4 * head_stride + 2 * head_stride, generator=g)
    q = qkv[:, :4 * head_stride].view(3, 4, head_stride)[..., :16]
    k = qkv[:, 4 * head_stride:].view(3, 2, head_stride)[..., :16]
    cos, sin, positions = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g), torch.tensor([0, 17, 39])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotate_half = lambda x: torch.cat((-x[..., 8:], x[..., :8]), dim=-1)  # noqa: E731
    expected_q, expected_k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    fused_ops.rotary_embedding(positions, q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


H, HK, D, BS = 6, 2, 16, 4


def _attention(window, lens, queries, kv_dtype=torch.float32, d=D):
    """Outputs of one step over sequences of `lens` keys with `queries` new rows each, through the
    backend (the fused kernel unless CORECTL_FUSED_KERNELS=0), over a cache of `kv_dtype`."""
    g = torch.Generator().manual_seed(3)
    backend = TorchSDPABackend(H, HK, d, torch.float32, torch.device("cpu"), BS)
    width = max(-(-n // BS) for n in lens)
    tables = torch.arange(len(lens) * width, dtype=torch.int32).flip(0).view(len(lens), width)
    cache = torch.randn(backend.kv_cache_shape(len(lens) * width, BS, HK, d), generator=g).to(kv_dtype)
    slots = [int(tables[i, p // BS]) * BS + p % BS for i, n in enumerate(lens) for p in range(n - queries[i], n)]
    t = sum(queries)
    batch_args = dict(query_start_loc=torch.tensor([0, *queries]).cumsum(0).int(), seq_lens=torch.tensor(lens).int(),
                      block_tables=tables, slot_mapping=torch.tensor(slots), query_lens_host=list(queries),
                      seq_lens_host=list(lens), max_query_len=max(queries), max_seq_len=max(lens), block_size=BS)
    meta = backend.build_metadata(AttentionBatch(**batch_args))
    q, k, v = (torch.randn(t, n, generator=g) for n in (H * d, HK * d, HK * d))
    return backend.forward(q, k, v, cache, meta, d ** -0.5, sliding_window=window), meta


# 24: head dims off the kernel's 16-number vectors (its tail and its portable value loop)
@pytest.mark.parametrize("d", [D, 24])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("queries", [(1, 1, 1), (5, 1, 3)], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_matches_the_torch_path(queries, window, kv_dtype, d, monkeypatch):
    """An fp16 cache: both paths round the new K/V rows to fp16 the same way and read the same numbers."""
    lens = (37, 9, 100)
    fused, meta = _attention(window, lens, queries, kv_dtype, d)
    assert meta.fused is not None
    monkeypatch.setenv("CORECTL_FUSED_KERNELS", "0")
    reference, meta = _attention(window, lens, queries, kv_dtype, d)
    assert meta.fused is None
    assert_close(fused, reference, 2e-6, norm="max")


def test_an_fp16_cache_stays_near_the_fp32_one():
    """fp16 keeps 11 significant bits of each K/V number (relative error <= 2^-11); over unit-normal
    K/V the outputs move by well under 1e-2 of their largest."""
    lens, queries = (37, 9, 100), (5, 1, 3)
    half, _ = _attention(None, lens, queries, torch.float16)
    full, _ = _attention(None, lens, queries, torch.float32)
    assert_close(half, full, 2e-3, norm="max")
    assert not torch.equal(half, full)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"], ids=["avx2-f16c", "no-f16c"])
def test_attention_on_other_cpus_gives_this_cpus_bits(arch, monkeypatch):
    """The loops other CPUs build (AVX2 with F16C, or the portable fp16 conversions and sums) round
    and sum as this CPU's do (AVX-512 where it has it): the same bits, head dims on and off 16."""
    cases = [(kv_dtype, d) for kv_dtype in (torch.float32, torch.float16) for d in (D, 24)]
    native = [_attention(None, (37, 9, 100), (5, 1, 3), kv_dtype, d)[0] for kv_dtype, d in cases]
    lib = fused_ops.fused_library(arch)
    monkeypatch.setattr(fused_ops, "fused_library", lambda: lib)
    for (kv_dtype, d), expected in zip(cases, native):
        assert torch.equal(_attention(None, (37, 9, 100), (5, 1, 3), kv_dtype, d)[0], expected)


def test_attention_rows_are_the_same_for_any_thread_count():
    """One long decode row and two threads: the kernel then shares out single query heads instead of
    a KV head's group of them, by the same operations per head."""
    lens, queries, previous = (1500,), (1,), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _attention(None, lens, queries, torch.float16)
        torch.set_num_threads(2)
        two, _ = _attention(None, lens, queries, torch.float16)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


VOCAB = 256
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_gguf_llm(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("fused_layer")
    dense = build_random_checkpoint("llama", root / "dense", default_model_dir, seed=4, initializer_range=0.1,
                                    vocab_size=VOCAB)
    path = write_gguf(dense, root / "tiny.gguf", dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), Q.Q4_1))
    return LLM(str(path), kv_cache_memory_gib=0.02, max_model_len=96, num_threads=1)


def _generate(llm, kernels):
    install_layer_kernels(llm.engine.executor.worker.runner.model, kernels)
    llm.engine.scheduler.kv.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(3, vocab=VOCAB)], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def test_a_whole_layer_call_gives_the_per_operator_bits_and_the_torch_tokens(tiny_gguf_llm, monkeypatch):
    kernels = fused_layer.cpu_layer_kernels(torch.float32)
    calls = []

    def counted(*args):
        out = fused_layer.decoder_layer(*args)
        calls.append(out is not None)
        return out

    whole = _generate(tiny_gguf_llm, dataclasses.replace(kernels, decoder_layer=counted))
    assert calls and all(calls)
    assert _generate(tiny_gguf_llm, dataclasses.replace(kernels, decoder_layer=None)) == whole
    monkeypatch.setenv("CORECTL_FUSED_KERNELS", "0")
    torch_path = _generate(tiny_gguf_llm, None)
    assert [tokens for tokens, _ in torch_path] == [tokens for tokens, _ in whole]
    install_layer_kernels(tiny_gguf_llm.engine.executor.worker.runner.model, kernels)
