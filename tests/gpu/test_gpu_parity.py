"""Greedy bf16 generation on the GPU against transformers on the same random-weight checkpoints."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from support.gpu import compare_greedy, generate, random_prompts  # noqa: E402

NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 17, 40, 64, 100, 130, 257, 600)
# bf16 logits move by a few units in the last place (1/16 nat near 10, 1/8 near 20) between
# implementations; a tie can part by two such steps on each side.
TIE_TOLERANCE = 0.5
# Chosen-token logprobs on positions that match: bf16 noise is ~0.01-0.05 nat; a wrong key or
# position costs whole nats.
LOGPROB_TOLERANCE = 0.3


def hf_greedy_logprobs(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from transformers' own forward and KV cache, and each step's log-softmax [n, V]."""
    device = next(model.parameters()).device
    tokens, rows = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
        for _ in range(new_tokens):
            row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            tokens.append(int(row.argmax()))
            rows.append(row.cpu())
            out = model(torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, torch.stack(rows)


def test_greedy_matches_transformers_in_bf16(checkpoint):
    _assert_greedy_matches_transformers(checkpoint)


def test_greedy_matches_transformers_with_every_dense_layer_on_the_gemv(checkpoint, monkeypatch):
    """The dense decode GEMV in place of cuBLAS for every decode-sized linear layer and the LM head
    (the launch rule keeps F.linear for some shapes at 2-8 rows; here every shape and batch takes it),
    CUDA graphs on: the same agreement with transformers."""
    from corectl.backends.triton import layer_kernels
    from corectl.backends.triton.gemm.fp8_gemv import MAX_M, GemvConfig

    def every_shape(m, n, k, gated, device):
        if m == 1:
            return GemvConfig(1, 8, 256, 1, 4, 3)
        return GemvConfig(16, 32, 128, 2, 4, 3) if m <= MAX_M else None

    monkeypatch.setattr(layer_kernels, "dense_decode_config", every_shape)
    _assert_greedy_matches_transformers(checkpoint)


def _assert_greedy_matches_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(PROMPT_LENGTHS)
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    references = [hf_greedy_logprobs(hf_model, p, NEW_TOKENS) for p in prompts]
    del hf_model
    torch.cuda.empty_cache()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    outputs = generate(checkpoint, prompts, params)
    worst, diverged = 0.0, 0
    for (expected, rows), out in zip(references, outputs):
        completion = out.outputs[0]
        got_logprobs = [next(iter(position.values())).logprob for position in completion.logprobs]
        matched, error = compare_greedy(expected, completion.token_ids, lambda pos, tok: rows[pos, tok].item(),
                                        got_logprobs, TIE_TOLERANCE)
        worst, diverged = max(worst, error), diverged + (matched < NEW_TOKENS)
    print(f"{checkpoint.name}: max chosen-token logprob error {worst:.4f} nat; "
          f"{diverged} of {len(prompts)} prompts parted at a near-tie")
    assert worst < LOGPROB_TOLERANCE
