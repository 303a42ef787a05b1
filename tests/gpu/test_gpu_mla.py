"""DeepSeek's multi-head latent attention on the GPU: the latent kernel at DeepSeek-V2-Lite's shape
against the torch reference, and greedy bf16 generation of a random DeepSeek-V2 checkpoint with real
MLA widths (latent 512, rope 64, nope 128, 16 heads) against transformers on the same GPU; on two
GPUs, tensor-parallel ranks and pipeline stages against one."""
import dataclasses

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from corectl.backends.triton.bench import mla  # noqa: E402
from support.gpu import (  # noqa: E402
    INIT_STD,
    compare_greedy,
    compare_greedy_outputs,
    generate,
    random_prompts,
    write_tokenizer,
)

VOCAB = 16384
NEW_TOKENS = 16
# bf16 ties and logprob noise as in test_gpu_parity.py.
TIE_TOLERANCE = 0.5
LOGPROB_TOLERANCE = 0.3


def test_latent_kernel_matches_the_reference_at_v2_lite_shape():
    torch.manual_seed(0)
    results = mla.check_latent(mla.V2_LITE, "cuda", torch.bfloat16)
    assert all(error < 1e-2 for _, error in results), results


@pytest.mark.parametrize("splits", [8, 16])
def test_split_decode_replays_in_a_cuda_graph_with_persistent_tickets(splits):
    """The split decode captured as the engine captures it, its last split program combining (8
    splits, over the backend's kind of persistent tickets) or a combine launch after it (16): replays
    before and after the contexts shrink equal eager launches bit for bit, the tickets left zeroed."""
    from corectl.backends.triton.attention.latent_attention import paged_latent_attention

    torch.manual_seed(0)
    s = dataclasses.replace(mla.V2_LITE, num_seqs=8, context=1000)
    batch, cache, q = mla._latent_batch(s, [s.context - 97 * i for i in range(s.num_seqs)], torch.bfloat16, "cuda")
    tickets = torch.zeros(64, dtype=torch.int32, device="cuda")
    out = torch.empty(s.num_seqs, s.num_heads, s.rank, dtype=torch.bfloat16, device="cuda")

    def decode(**buffers):
        return paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, 0.1, rank=s.rank,
                                      max_seq_len=s.context, num_splits=splits, check_indices=False, **buffers)

    decode(out=out, tickets=tickets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(out=out, tickets=tickets)
    for shrink in (0, 300):
        batch.seq_lens.sub_(shrink)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode())
        assert not tickets.any()


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    config = DeepseekV2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                              num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                              kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                              v_head_dim=128, max_position_embeddings=2048, initializer_range=INIT_STD,
                              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("deepseek-v2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    return folder


def test_deepseek_greedy_matches_transformers_in_bf16(deepseek_checkpoint):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts((5, 17, 64, 130, 257))
    hf_model = AutoModelForCausalLM.from_pretrained(deepseek_checkpoint, dtype=torch.bfloat16).cuda().eval()
    references = []
    with torch.no_grad():
        for prompt in prompts:
            logits = hf_model(torch.tensor([prompt], device="cuda")).logits[0, -1:]
            tokens, rows = [], []
            sequence = list(prompt)
            for _ in range(NEW_TOKENS):
                row = torch.log_softmax(logits[-1].float(), dim=-1).cpu()
                tokens.append(int(row.argmax()))
                rows.append(row)
                sequence.append(tokens[-1])
                logits = hf_model(torch.tensor([sequence], device="cuda")).logits[0, -1:]
            references.append((tokens, torch.stack(rows)))
    del hf_model
    torch.cuda.empty_cache()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    worst = 0.0
    captured = []

    def watch(llm):
        runner = llm.engine.executor.worker.runner
        captured.append(runner.model.supports_graph_capture and bool(runner.graphs))

    for (expected, rows), out in zip(references, generate(deepseek_checkpoint, prompts, params, watch)):
        completion = out.outputs[0]
        got = [next(iter(position.values())).logprob for position in completion.logprobs]
        _, error = compare_greedy(expected, completion.token_ids, lambda pos, tok: rows[pos, tok].item(), got,
                                  TIE_TOLERANCE)
        worst = max(worst, error)
    assert worst < LOGPROB_TOLERANCE
    # Its experts ran the fused MoE kernel with DeepSeek's routing, so its decode steps ran in CUDA graphs.
    assert captured == [True]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA or ROCm GPUs")
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_gpus_give_the_tokens_of_one(deepseek_checkpoint, split):
    """Eight heads a rank over the latent every rank caches whole (TP), or two stages (PP), in CUDA
    graphs, against one GPU in bf16: equal except where one GPU rates the two tokens a near-tie."""
    prompts = random_prompts((5, 17, 64, 130, 257), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    one = generate(deepseek_checkpoint, prompts, params)
    two = generate(deepseek_checkpoint, prompts, params, **split)
    assert compare_greedy_outputs(one, two, TIE_TOLERANCE, exact=False) < LOGPROB_TOLERANCE


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA or ROCm GPUs")
def test_block_fp8_at_two_ranks_gives_the_tokens_of_one(deepseek_checkpoint, tmp_path):
    """The same model quantized as DeepSeek V3 ships (every projection e4m3 in 128 x 128 blocks, the
    experts too): each of two ranks runs its heads' rows of q and kv_b through the block GEMM."""
    from support.quant_checkpoints import write_block_fp8_checkpoints

    projections = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    quantized, _ = write_block_fp8_checkpoints(deepseek_checkpoint, tmp_path, (128, 128), projections)
    prompts = random_prompts((5, 17, 64, 130, 257), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    one = generate(quantized, prompts, params)
    two = generate(quantized, prompts, params, tensor_parallel_size=2)
    assert compare_greedy_outputs(one, two, TIE_TOLERANCE, exact=False) < LOGPROB_TOLERANCE
