"""Pipeline stages of architectures beyond Llama on two GPUs (NCCL), bf16, CUDA graphs where the
model takes them: Gemma 2 (one residual stream between stages, soft caps, local and global layers),
Phi-3 (fused checkpoint tensors, each stage loading its own) and gpt-oss (sinks, biased experts on
the torch path). PP = 2 gives one GPU's greedy tokens, except where one GPU itself rates the two
tokens within a near-tie; the CPU suite checks the same models token-exact in fp32.
"""
import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA or ROCm GPUs", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from support.gpu import compare_greedy_outputs, generate, write_tokenizer  # noqa: E402
from support.new_arch_configs import gpt_oss_config  # noqa: E402

VOCAB = 4096
LENGTHS = (5, 40, 130, 300, 17, 64)
NEW_TOKENS = 12
TIE_TOLERANCE = 0.5
LOGPROB_TOLERANCE = 0.3


def _config(arch: str):
    from transformers import Gemma2Config, Phi3Config

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gemma2":
        return Gemma2Config(**common, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
                            attn_logit_softcapping=30.0, final_logit_softcapping=20.0)
    if arch == "phi3":
        return Phi3Config(**common, tie_word_embeddings=False)
    return gpt_oss_config(vocab_size=VOCAB, max_position_embeddings=2048)


@pytest.fixture(scope="module", params=["gemma2", "phi3", "gpt-oss"])
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.bfloat16).save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    return folder


def test_two_stages_give_the_tokens_of_one_gpu(checkpoint):
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    one = generate(checkpoint, prompts, params)
    two = generate(checkpoint, prompts, params, pipeline_parallel_size=2)
    worst = compare_greedy_outputs(one, two, TIE_TOLERANCE, exact=False)
    print(f"{checkpoint.name}: PP = 2 against one GPU, max chosen-token logprob difference {worst:.4f} nat")
    assert worst < LOGPROB_TOLERANCE
