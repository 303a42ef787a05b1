"""Greedy output on the CPU does not depend on the batch: each of 16 prompts gives the same tokens
among all 16 at once and again after a prefix-cache hit, and five of them the same generated alone,
on the embedded SmolLM2 GGUF served the default way (4-bit layers and its Q8_0 head, fp32 around them),
with `LLM(batch_invariant=True)`, which CPUs accept without changing a kernel.

What would break it: a GEMM whose per-row result changes with the number of rows (oneDNN's fp32
GEMM runs one row through another kernel than several; torch's int4 GEMM needs bf16 activations),
or attention whose rows see padding. Each prompt's 16 tokens are compared whole."""
from __future__ import annotations

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.attention import AttentionBatch
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.quantization import int4_cpu
from support.close import assert_close

TOPICS = ["the ocean", "a small robot that learns to paint", "the history of tea", "winter in the mountains",
          "how bread is made", "a lighthouse keeper and his dog", "the planet Mars", "learning to swim",
          "an old library", "city traffic at night", "a jazz musician", "the first computer",
          "a long desert journey on foot", "honeybees", "a rainy afternoon", "chess strategy for beginners"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# The prompts also run alone at these rows of the batch: its first, last and three between. A run
# alone costs as much as the whole batch's, and each of the 16 rows is a row of the same GEMMs.
ALONE = (0, 4, 9, 12, 15)


@pytest.fixture(scope="module")
def llm_default():
    # One thread: no kernel's per-row result depends on the thread count, and one thread stays fast
    # on a loaded machine (two wait on each other at every parallel region).
    # --batch-invariant is accepted and changes nothing on CPUs (their kernels are the default ones),
    # so this engine also proves the flag's CPU promise.
    llm = LLM(max_model_len=256, kv_cache_memory_gib=0.05, max_num_seqs=16, num_threads=1, batch_invariant=True)
    assert llm.engine.info.quantization == "gguf (Q4_1 int4 layers via cpu_int4pack)"
    assert llm.config.batch_invariant
    return llm


def _tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_greedy_tokens_alone_equal_batched_and_after_a_prefix_hit(llm_default):
    tok = llm_default.get_tokenizer()
    # Chat-formatted: ~30 tokens each, so every prompt fills at least one 16-token block to hit.
    prompts = [tok.encode_chat([{"role": "user", "content": f"Write a story about {t}."}]) for t in TOPICS]
    batched = _tokens(llm_default.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    alone = {}
    for i in ALONE:
        llm_default.engine.scheduler.kv.reset_prefix_cache()  # alone: no prefix of another prompt either
        out = llm_default.generate({"prompt_token_ids": prompts[i]}, GREEDY, use_tqdm=False)
        assert out[0].num_cached_tokens == 0
        alone[i] = _tokens(out)[0]
    hit_outputs = llm_default.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens >= 16 for out in hit_outputs)
    hit = _tokens(hit_outputs)
    differ = [i for i in range(len(prompts)) if not batched[i] == hit[i] == alone.get(i, batched[i])]
    assert not differ, f"prompts {differ} gave other tokens alone, batched or after a prefix hit"


# The kernels on their own, bitwise: a row's result alone equals it among other rows.
H, HK, D, BS = 6, 2, 16, 4


def _attention(backend, seqs, kv_dtype):
    """Attention outputs per sequence for `seqs` = [(keys [S, HK, D], values, queries [Q, H * D], cached)],
    each in blocks of its own, the cached prefix written to the cache (of `kv_dtype`) first."""
    width = max(-(-len(k) // BS) for k, _, _, _ in seqs)
    tables = torch.arange(len(seqs) * width, dtype=torch.int32).view(len(seqs), width)
    cache = torch.zeros(backend.kv_cache_shape(len(seqs) * width, BS, HK, D), dtype=kv_dtype)
    slots = []
    for i, (keys, values, _, cached) in enumerate(seqs):
        seq_slots = [int(tables[i, p // BS]) * BS + p % BS for p in range(len(keys))]
        for p in range(cached):
            cache[0].view(-1, HK, D)[seq_slots[p]], cache[1].view(-1, HK, D)[seq_slots[p]] = keys[p], values[p]
        slots += seq_slots[cached:]
    q_lens = [len(q) for _, _, q, _ in seqs]
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor([len(k) for k, _, _, _ in seqs], dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots), query_lens_host=q_lens, seq_lens_host=[len(k) for k, _, _, _ in seqs],
        max_query_len=max(q_lens), max_seq_len=max(len(k) for k, _, _, _ in seqs), block_size=BS)
    new = lambda t: torch.cat([x[c:] for x, c in zip(t, [s[3] for s in seqs])]).view(sum(q_lens), -1)  # noqa: E731
    out = backend.forward(torch.cat([q for _, _, q, _ in seqs]), new([s[0] for s in seqs]), new([s[1] for s in seqs]),
                          cache, backend.build_metadata(batch), D ** -0.5)
    return out.split(q_lens)


def _seq(length, queries, cached, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(length, HK, D, generator=g), torch.randn(length, HK, D, generator=g),
            torch.randn(queries, H * D, generator=g), cached)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("queries,cached", [(1, 36), (37, 0), (21, 16)], ids=["decode", "prefill", "prefix-hit"])
def test_attention_rows_do_not_depend_on_the_batch(queries, cached, kv_dtype):
    backend = TorchSDPABackend(H, HK, D, torch.float32, torch.device("cpu"), BS)
    target = _seq(37, queries, cached, seed=0)
    alone = _attention(backend, [target], kv_dtype)[0]
    others = [_seq(100, 1 if queries == 1 else 30, 99 if queries == 1 else 70, seed=1),
              _seq(5, 1 if queries == 1 else 5, 4 if queries == 1 else 0, seed=2)]
    assert torch.equal(_attention(backend, [others[0], target, others[1]], kv_dtype)[1], alone)
    if cached:  # the same prompt's last rows computed whole, without the cache hit
        prompt = torch.cat([_seq(37, cached, 0, seed=3)[2], target[2]])
        whole = _attention(backend, [(*target[:2], prompt, 0)], kv_dtype)[0]
        assert torch.equal(whole[cached:], alone)


@pytest.mark.parametrize("arch", ["native", "x86-64-v3"], ids=["native", "avx2"])
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_gemm_rows_do_not_depend_on_the_batch(bits, arch, monkeypatch):
    """Each inner loop (this CPU's and the AVX2 one other CPUs build) on its own layout: rows alone equal
    rows among others, and all are near the fp32 product of the dequantized weights."""
    lib = int4_cpu.kernel_library(arch)
    if lib is None:
        pytest.skip("no C compiler to build the kernel")
    monkeypatch.setattr(int4_cpu, "kernel_library", lambda: lib)
    g = torch.Generator().manual_seed(0)
    n, k = 48, 128
    scales = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()  # the kernel keeps fp16 scales and mins
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g)
        mins = (torch.randn(n, k // 32, generator=g) * 0.1).half().float()
        packed, scale_zero = int4_cpu.pack_int4(codes, scales, mins + 8 * scales)
        gemm = lambda x: int4_cpu.int4_linear(x, packed, scale_zero, 32, None)  # noqa: E731
    else:
        codes = torch.randint(-127, 128, (n, k), generator=g)
        mins = torch.zeros_like(scales)
        packed, scale_zero = int4_cpu.pack_int8(codes, scales)
        gemm = lambda x: int4_cpu.int8_linear(x, packed, scale_zero, 32)  # noqa: E731
    x = torch.randn(40, k, generator=g)
    batched = gemm(x)
    # Rows alone (the VNNI loop) equal rows in blocks of 16 and 13 (AMX where the CPU has it) and of 8.
    assert torch.equal(torch.cat([gemm(row[None]) for row in x]), batched)
    assert torch.equal(gemm(x[3:20]), batched[3:20])
    assert torch.equal(gemm(x[:13]), batched[:13])
    weight = (codes.view(n, k // 32, 32) * scales[..., None] + mins[..., None]).view(n, k)
    # int16 activations (AVX512-VNNI, AMX) give ~2e-5 here, fp32 ones (AVX2) less; bf16 ones would give ~2e-3
    assert_close(batched, (x.double() @ weight.double().t()).float(), 2e-4, norm="max")
    x[5, 77] = float("nan")  # a NaN input reaches every output of its row and no other row
    poisoned = gemm(x)
    assert poisoned[5].isnan().all() and torch.equal(poisoned[6:], batched[6:])
