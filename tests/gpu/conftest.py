"""The GPU suite: real kernels at real sizes, bf16 parity with transformers, CUDA graphs.

Every module skips itself without CUDA. Run the suite in its own pytest process
(`python -m pytest tests/gpu`): tests/conftest.py turns Triton's interpreter on for the CPU kernel
tests, and Triton fixes a kernel's mode when its module is imported. So when only this folder is
requested the interpreter is switched off here, before any kernel module loads; in a session
mixing suites the GPU tests skip, saying why.

Models are small random-weight checkpoints of real architectures, written with a word-level
tokenizer covering their vocabulary: nothing is downloaded and no GGUF conversion is needed.
"""
from __future__ import annotations

import gc
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).parent.resolve()
VOCAB_SIZE = 16384
# A few layers of real head sizes: Llama's 64-wide heads in groups of 4, Qwen3's 128-wide heads
# with q/k norms and tied embeddings.
ARCHITECTURES = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True),
}
# Scores of a few units: attention neither uniform nor one-hot, so which keys it reads matters.
INIT_STD = 0.1


def pytest_configure(config):
    if not torch.cuda.is_available():
        return
    root = config.invocation_params.dir
    targets = [(root / arg.split("::")[0]).resolve() for arg in config.args]
    if targets and all(t == GPU_DIR or GPU_DIR in t.parents for t in targets):
        os.environ["TRITON_INTERPRET"] = "0"


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    from triton.runtime.interpreter import InterpretedFunction

    from corectl.backends.triton import decode_attention

    if isinstance(decode_attention._decode_kernel, InterpretedFunction):
        pytest.skip("the Triton kernels were loaded for the CPU interpreter (TRITON_INTERPRET=1) by another "
                    "suite in this session: run `python -m pytest tests/gpu` on its own")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose tokens are `t0`..`t{n-1}` (t1 = BOS, t2 = EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
              "unk_token": "t0", "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_checkpoint(arch: str, folder: Path, seed: int = 0) -> Path:
    """Save a random-weight bf16 model of `arch` with its tokenizer as an HF directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    config = config_cls(vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        max_position_embeddings=2048, initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2,
                        **ARCHITECTURES[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB_SIZE)
    return folder


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@contextmanager
def engine(folder: Path, **options):
    """An `LLM` on the GPU whose memory is given back on exit, so the next one can size its KV cache."""
    from corectl import LLM

    settings = dict(platform="cuda", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
                    max_num_seqs=32)
    llm = LLM(str(folder), **{**settings, **options})
    try:
        yield llm
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def compare_greedy(expected: list[int], got: list[int], expected_logprob, got_logprobs: list[float],
                   tie_tolerance: float) -> tuple[int, float]:
    """Compare a greedy continuation with a reference; returns (positions matched, max |logprob error|).

    Token-exact, except where two implementations round differently at a near-tie: at the first
    differing position the reference must rate our token within `tie_tolerance` nats of its own
    (`expected_logprob(position, token)`, None when it did not keep that token). The sequences
    continue from different tokens after that, so the comparison stops there.
    """
    max_error = 0.0
    for pos, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            ours = expected_logprob(pos, have)
            gap = None if ours is None else expected_logprob(pos, want) - ours
            assert gap is not None and gap <= tie_tolerance, (
                f"position {pos}: got token {have}, reference {want} (reference logprob gap {gap}); "
                f"tokens so far {got[:pos + 1]} vs {expected[:pos + 1]}")
            return pos, max_error
        max_error = max(max_error, abs(expected_logprob(pos, want) - got_logprobs[pos]))
    return min(len(expected), len(got)), max_error
