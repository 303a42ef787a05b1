"""Sliding-window and soft-capped attention on the GPU: the Triton kernels at Mistral-7B's head sizes
against the torch reference in bf16 (keys outside every window poisoned with NaN, as blocks the KV
manager has returned to the pool may hold anything), a captured decode graph replaying windowed
launches, and greedy bf16 generation of windowed models against transformers."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from corectl.backends.triton.attention.decode_attention import choose_decode_splits, paged_decode_attention  # noqa: E402
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention  # noqa: E402
from corectl.backends.triton.bench.paged_batch import (  # noqa: E402
    contiguous_attention_ref,
    poison_outside_windows,
    random_paged_batch,
)
from support.close import relative_error  # noqa: E402
from support.gpu import VOCAB_SIZE, compare_greedy, generate, random_prompts, write_tokenizer  # noqa: E402

MISTRAL_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
SCALE = 128 ** -0.5
# Relative L2 error of a bf16 kernel against an fp32 reference: a few bf16 roundings (2**-8 each).
REL_TOL = 1e-2


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "the kernel read a key outside every window (NaN) or left rows unwritten"
    return relative_error(out, ref)


@pytest.mark.parametrize("window, soft_cap", [(4096, None), (1000, None), (4096, 50.0)])
def test_windowed_decode_at_mistral_sizes(window, soft_cap):
    torch.manual_seed(0)
    seq_lens = [6000, 4096, 4097, 300, 9000, 1]
    batch = random_paged_batch(seq_lens, [1] * len(seq_lens), **MISTRAL_HEADS, dtype=torch.bfloat16,
                               device="cuda", store_new_tokens=True)
    poison_outside_windows(batch, window)
    masking = dict(sliding_window=window, logits_soft_cap=soft_cap)
    expected = contiguous_attention_ref(batch, SCALE, **masking)
    for splits in (1, 8):
        out = paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                                     max_seq_len=max(seq_lens), num_splits=splits, **masking)
        assert _rel_error(out, expected) < REL_TOL, f"{splits} splits"


@pytest.mark.parametrize("window, soft_cap", [(4096, None), (700, 50.0)])
def test_windowed_prefill_at_mistral_sizes(window, soft_cap):
    torch.manual_seed(0)
    # A cold prefill longer than the window, a chunk after a long cached prefix, decode rows.
    seq_lens, query_lens = [5000, 7000, 4500, 90], [5000, 1024, 1, 1]
    batch = random_paged_batch(seq_lens, query_lens, **MISTRAL_HEADS, dtype=torch.bfloat16, device="cuda",
                               store_new_tokens=True)
    poison_outside_windows(batch, window)
    masking = dict(sliding_window=window, logits_soft_cap=soft_cap)
    out = paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, SCALE, max_query_len=max(query_lens), **masking)
    assert _rel_error(out, contiguous_attention_ref(batch, SCALE, **masking)) < REL_TOL


def test_windowed_decode_replays_in_a_cuda_graph():
    """A layer's window is fixed at capture; lengths and tables change between replays."""
    torch.manual_seed(0)
    window, bucket = 512, 8
    first = random_paged_batch([2000, 600, 100, 513, 1500, 40, 1024, 3000], [1] * bucket, **MISTRAL_HEADS,
                               dtype=torch.bfloat16, device="cuda", store_new_tokens=True)
    q, tables, lens = first.q.clone(), first.block_tables.clone(), first.seq_lens.clone()
    kv_cache = first.kv_cache
    out = torch.empty_like(q)
    splits = choose_decode_splits(bucket, 8, 4096, torch.device("cuda"))

    def decode():
        paged_decode_attention(q, kv_cache, tables, lens, SCALE, max_seq_len=4096, num_splits=splits, out=out,
                               check_indices=False, sliding_window=window)

    decode()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    for lengths in ([700, 600, 5, 512, 1600, 41, 1030, 3001], [1] * bucket):
        batch = random_paged_batch(lengths, [1] * bucket, **MISTRAL_HEADS, dtype=torch.bfloat16, device="cuda",
                                   store_new_tokens=True)
        poison_outside_windows(batch, window)
        kv_cache.zero_()
        kv_cache[:, :batch.kv_cache.shape[1]] = batch.kv_cache  # the graph reads the captured storage
        q.copy_(batch.q)
        tables.zero_()
        tables[:, :batch.block_tables.shape[1]] = batch.block_tables
        lens.copy_(batch.seq_lens)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_error(out, contiguous_attention_ref(batch, SCALE, sliding_window=window)) < REL_TOL


def _windowed_checkpoint(arch: str, folder):
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1, bos_token_id=1,
                  eos_token_id=2, sliding_window=64)
    gemma = dict(common, head_dim=64, num_hidden_layers=4, query_pre_attn_scalar=64)
    config = {
        "mistral": lambda: MistralConfig(**common, num_hidden_layers=4, tie_word_embeddings=False),
        "gemma3": lambda: Gemma3TextConfig(**gemma, sliding_window_pattern=2),
        "gemma2": lambda: Gemma2Config(**gemma, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB_SIZE)
    return folder


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "gemma2"])
def test_windowed_models_match_transformers_in_bf16(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    new_tokens = 16
    folder = _windowed_checkpoint(arch, tmp_path / arch)
    prompts = random_prompts((30, 65, 130, 300, 700))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    references = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model(torch.tensor([prompt], device="cuda"), use_cache=True)
            tokens, rows = [], []
            for _ in range(new_tokens):
                rows.append(torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu())
                tokens.append(int(rows[-1].argmax()))
                out = hf_model(torch.tensor([[tokens[-1]]], device="cuda"), past_key_values=out.past_key_values,
                               use_cache=True)
            references.append((tokens, torch.stack(rows)))
    del hf_model
    torch.cuda.empty_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, ignore_eos=True)
    for (expected, rows), out in zip(references, generate(folder, prompts, params)):
        completion = out.outputs[0]
        got = [next(iter(position.values())).logprob for position in completion.logprobs]
        _, error = compare_greedy(expected, completion.token_ids, lambda pos, tok: rows[pos, tok].item(), got, 0.5)
        assert error < 0.3
