"""Greedy parity against transformers for sliding-window models: Mistral (a window on every layer),
Gemma 3 (local and global layers, per-type rotary bases, q/k norms) and Gemma 2 (soft-capped
attention and logits). Random weights, fp32, prompts longer than the 8-token window.

The engine runs with 8-token blocks, so Mistral's requests return blocks to the pool as they
decode; the last tests run Gemma 2 and Mistral through the Triton backend under the interpreter,
with the KV cache in the model's dtype and in FP8.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.backends.cpu.platform import CPUPlatform
from corectl.backends.cpu.worker import CPUWorker
from corectl.backends.triton.attention.backend import TritonAttentionBackend
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.loaders import resolve_model_source
from corectl.request import Request
from corectl.scheduler import Scheduler
from support.models import hf_greedy

NEW_TOKENS = 16
WINDOW = 8
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, bos_token_id=1,
              eos_token_id=2, sliding_window=WINDOW)


def _config(arch: str):
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig

    if arch == "mistral":
        return MistralConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    gemma = dict(COMMON, head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24,
                 hidden_activation="gelu_pytorch_tanh")
    if arch == "gemma3":
        # Layers 0-2 local (base 10k), layer 3 global (base 1M, linear scaling as the larger Gemma 3s).
        return Gemma3TextConfig(**gemma, sliding_window_pattern=4, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})
    # Caps low enough that random weights reach them.
    return Gemma2Config(**gemma, attn_logit_softcapping=3.0, final_logit_softcapping=20.0)


def _checkpoint(arch: str, folder, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    hf_model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()
    hf_model.save_pretrained(folder)
    for item in tokenizer_dir.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)
    return hf_model


def _prompts(count: int, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (9, 12, 17, 21, 26, 30, 35, 40)[:count]]


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "gemma2"])
def test_greedy_tokens_match_transformers(arch, tmp_path, default_model_dir):
    hf_model = _checkpoint(arch, tmp_path / arch, default_model_dir)
    llm = LLM(str(tmp_path / arch), dtype="float32", kv_cache_memory_gib=0.02, block_size=8)
    assert llm.engine.max_model_len == 512  # the window caps nothing
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts(8)
    for out, prompt in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
        expected, _ = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{arch}, prompt of {len(prompt)} tokens"
    kv = llm.engine.scheduler.kv
    # Only Mistral is windowed on every layer; Gemma's global layers keep every block.
    assert (kv.sliding_window, kv.num_windowed_out_blocks > 0) == ((WINDOW, True) if arch == "mistral" else (None, False))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_two_pipeline_stages_match_transformers(arch, tmp_path, default_model_dir):
    """Gemma in two stages over gloo (local layers on the first, layer 3 global on the second for
    Gemma 3): one residual stream crosses, and the last stage keeps the tied embedding for its head."""
    hf_model = _checkpoint(arch, tmp_path / arch, default_model_dir)
    llm = LLM(str(tmp_path / arch), dtype="float32", kv_cache_memory_gib=0.02, block_size=8, pipeline_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompts = _prompts(4)
        for out, prompt in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)[0], arch
    finally:
        llm.engine.executor.shutdown()


def test_prefix_hits_after_blocks_left_the_window(tmp_path, default_model_dir):
    """Follow-up prompts extend earlier conversations whose first blocks went back to the pool while
    they decoded: hits still give transformers' tokens, whether the chain survived or broke."""
    hf_model = _checkpoint("mistral", tmp_path / "m", default_model_dir)
    # Room for 15 blocks: the first blocks of finished requests get reused, breaking some chains.
    llm = LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory_gib=0.00006, block_size=8,
              max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = _prompts(4, seed=11)
    outputs = llm.generate(first, params, use_tqdm=False)
    follow_ups = [prompt + out.outputs[0].token_ids + [5, 6, 7] for prompt, out in zip(first, outputs)]
    for out, prompt in zip(llm.generate(follow_ups, params, use_tqdm=False), follow_ups):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)[0]
    stats = llm.engine.scheduler.make_stats()
    assert stats.prefix_cache_hits > 0 and llm.engine.scheduler.kv.num_windowed_out_blocks > 0


def test_window_and_caps_change_the_model(tmp_path, default_model_dir):
    """The parity above means something only if transformers' own logits depend on what we implement."""
    from transformers import AutoModelForCausalLM

    base = _checkpoint("gemma2", tmp_path / "g2", default_model_dir)
    prompt = torch.tensor([_prompts(8)[-1]])
    with torch.no_grad():
        logits = base(prompt).logits
    for change in (dict(sliding_window=4096), dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None)):
        config = _config("gemma2")
        for key, value in change.items():
            setattr(config, key, value)
        other = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        other.load_state_dict(base.state_dict())
        with torch.no_grad():
            assert (other(prompt).logits - logits).abs().max() > 0.1, change


def _run_triton_engine(folder, prompts, max_tokens, **options):
    """The real CPU worker and scheduler with the Triton attention backend in place of SDPA; returns
    each request's (token, top logprob) pairs and the scheduler."""
    config = EngineConfig(model=str(folder), dtype="float32", block_size=8, max_num_batched_tokens=16, **options)
    worker = CPUWorker(config, CPUPlatform(), resolve_model_source(config), dtype="float32", max_model_len=64,
                       eos_token_id=None, attention_backend_cls=TritonAttentionBackend)
    info = worker.load_model()
    worker.init_kv_cache(40)
    sched = Scheduler(config, 64, 40, sliding_window=info.sliding_window)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, params, max_tokens=max_tokens))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for result in sched.update(out, worker.launch(out).result()):
            outputs[result.req_id].append((result.new_token_ids[0], result.logprobs.logprobs[0][0]))
    return [outputs[f"r{i}"] for i in range(len(prompts))], sched, worker


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_triton_backend_under_the_interpreter(arch, tmp_path, default_model_dir):
    hf_model = _checkpoint(arch, tmp_path / arch, default_model_dir)
    prompts = _prompts(2, seed=5)
    outputs, sched, _ = _run_triton_engine(tmp_path / arch, prompts, 6)
    for prompt, output in zip(prompts, outputs):
        assert [token for token, _ in output] == hf_greedy(hf_model, prompt, 6)[0]
    # Mistral's requests gave blocks back while they ran: the kernels never read them afterwards.
    assert (sched.kv.num_windowed_out_blocks > 0) == (arch == "mistral")


def test_fp8_kv_cache_through_the_triton_backend(tmp_path, default_model_dir):
    """`kv_cache_dtype="fp8"`: e4m3 caches of a quarter of fp32's bytes, and the first token's
    logprob within e4m3's rounding of the fp32 cache's (random weights amplify that rounding
    into different tokens later on, so only the first step is compared)."""
    _checkpoint("mistral", tmp_path / "m", default_model_dir)
    prompts = _prompts(4, seed=5)
    full, _, full_worker = _run_triton_engine(tmp_path / "m", prompts, 2)
    fp8, _, fp8_worker = _run_triton_engine(tmp_path / "m", prompts, 2, kv_cache_dtype="fp8")
    assert {c.dtype for c in fp8_worker.runner.kv_caches} == {torch.float8_e4m3fn}
    assert fp8_worker.model_info.kv_bytes_per_block(8) * 4 == full_worker.model_info.kv_bytes_per_block(8)
    for exact, quantized in zip(full, fp8):
        assert abs(exact[0][1] - quantized[0][1]) < 0.3


def test_fp8_kv_cache_is_refused_by_the_cpu_backend(tmp_path, default_model_dir):
    _checkpoint("mistral", tmp_path / "m", default_model_dir)
    with pytest.raises(ConfigError, match="'torch_sdpa' attention backend stores only auto, float16 KV caches"):
        LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory_gib=0.02, kv_cache_dtype="fp8")
