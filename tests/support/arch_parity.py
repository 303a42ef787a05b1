"""Greedy parity of a random-weight checkpoint against transformers, through the real engine: a batch
of 3 prompts, then 3 follow-ups sharing their first blocks (prefix-cache hits), then the same batch
in a KV cache too small for it (preemption and recompute). fp32, 16 new tokens, 8-token blocks."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from corectl import LLM, SamplingParams

from .models import hf_greedy

NEW_TOKENS = 16
BLOCK = 8
MAX_MODEL_LEN = 64
LOGPROB_TOL = 1e-3


def save_random_model(config, folder: Path, tokenizer_dir: Path, seed: int = 0):
    """A transformers model of `config` with random weights (fp32), saved with the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_dir, folder)
    return model


def copy_tokenizer(tokenizer_dir: Path, folder: Path) -> None:
    """The SmolLM2 tokenizer's files (and chat template) into a checkpoint folder."""
    for item in tokenizer_dir.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)


def parity_prompts(vocab_size: int, seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """3 prompts of 12-23 tokens and 3 follow-ups keeping their first 16 (or 12) tokens: every
    sequence stays within 24 + 16 positions."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (12, 19, 23)]
    return prompts, [p[:16] + [5, 6, 7] for p in prompts]


def _check(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    for out, prompt in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
        expected, expected_lp = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        got_lp = [next(iter(pos.values())).logprob for pos in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, expected_lp)) < LOGPROB_TOL


def assert_engine_matches(folder: Path, hf_model, vocab_size: int, *, variant: bool = False, **options) -> LLM:
    """The three runs of the module doc; returns the roomy engine. A `variant` (another config of
    an architecture whose main config has the full runs) checks the first batch only, which keeps
    the suite's time down."""
    prompts, follow_ups = parity_prompts(vocab_size)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.01, block_size=BLOCK,
              max_model_len=MAX_MODEL_LEN, **options)
    _check(llm, hf_model, prompts)
    if variant:
        return llm
    _check(llm, hf_model, follow_ups)
    assert llm.engine.scheduler.make_stats().prefix_cache_hits > 0
    # Room for 9 blocks: one sequence's 64 positions and a bit; the batch needs 15.
    per_block = llm.engine.executor.worker.model_info.kv_bytes_per_block(BLOCK)
    tight = LLM(str(folder), dtype="float32", kv_cache_memory_gib=9.5 * per_block / 2**30, block_size=BLOCK,
                max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, **options)
    _check(tight, hf_model, prompts)
    assert tight.engine.scheduler.num_preemptions > 0
    return llm
