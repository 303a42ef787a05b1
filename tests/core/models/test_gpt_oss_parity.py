"""gpt-oss against transformers: attention sinks, alternating 8-token sliding-window and full layers,
YaRN rotary, attention biases, biased top-k router and experts with the clamped SwiGLU; greedy fp32
through prefix hits and preemption, dense and MXFP4 experts."""
from __future__ import annotations

import pytest
import torch
from corectl.attention import ForwardContext
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.errors import ConfigError
from corectl.models.layers import Attention
from support.arch_parity import assert_engine_matches
from support.gpt_oss_checkpoints import gpt_oss_checkpoint, mxfp4_checkpoint
from support.new_arch_configs import VOCAB, gpt_oss_config



def test_gpt_oss_greedy_matches_transformers(tmp_path, default_model_dir):
    hf_model = gpt_oss_checkpoint(tmp_path / "oss", default_model_dir)
    llm = assert_engine_matches(tmp_path / "oss", hf_model, VOCAB)
    windows = [layer.self_attn.attn.sliding_window for layer in llm.engine.executor.worker.runner.model.model.layers]
    assert windows == [8, None, 8, None]


def test_sinks_and_clamp_change_the_model(tmp_path, default_model_dir):
    """The parity above means something only if transformers' logits depend on the sinks and the
    clamp (the limit is low enough for random weights to reach it)."""
    from transformers import AutoModelForCausalLM

    base = gpt_oss_checkpoint(tmp_path / "oss", default_model_dir)
    prompt = torch.arange(3, 30)[None]
    with torch.no_grad():
        logits = base(prompt).logits[0, -1]
        for change in ("sinks", "clamp"):
            other = AutoModelForCausalLM.from_config(gpt_oss_config(swiglu_limit=100.0 if change == "clamp" else 1.5),
                                                     dtype=torch.float32).eval()
            other.load_state_dict(base.state_dict())
            if change == "sinks":
                for layer in other.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)
            assert (other(prompt).logits[0, -1] - logits).abs().max() > 0.1, change


def test_backend_without_sinks_is_refused():
    """A backend that does not declare sinks (a plugin's) gets a gpt-oss layer's refusal by name,
    never attention that silently ignores them."""

    class NoSinksBackend(TorchSDPABackend):
        name = "no_sinks"
        supports_sinks = False

    backend = NoSinksBackend(4, 2, 16, torch.float32, torch.device("cpu"), 8)
    attn = Attention(0, 4, 2, 16, sliding_window=8)
    attn.add_sinks(0, 4)
    q, kv = torch.zeros(3, 64), torch.zeros(3, 32)
    with pytest.raises(ConfigError, match="attention has sinks .* 'no_sinks' attention backend does not implement"):
        attn(q, kv, kv, ForwardContext(backend, None, [None]))


def test_triton_backend_under_the_interpreter(tmp_path, default_model_dir):
    """The real CPU worker and scheduler with the Triton kernels (sinks, windows) in place of SDPA."""
    from support.models import hf_greedy
    from test_sliding_window_parity import _run_triton_engine

    hf_model = gpt_oss_checkpoint(tmp_path / "oss", default_model_dir)
    prompts = [[5 + i for i in range(n)] for n in (11, 19)]
    outputs, _, _ = _run_triton_engine(tmp_path / "oss", prompts, 6)
    for prompt, output in zip(prompts, outputs):
        assert [token for token, _ in output] == hf_greedy(hf_model, prompt, 6)[0]


def test_mxfp4_experts_match_transformers(tmp_path, default_model_dir):
    """Experts quantized to MXFP4 in the checkpoint's layout; the reference is transformers with the
    experts its own MXFP4 dequantizer gives."""
    folder = tmp_path / "oss4"
    hf_model = mxfp4_checkpoint(folder, default_model_dir)
    llm = assert_engine_matches(folder, hf_model, VOCAB, variant=True)
    assert llm.engine.executor.worker.runner.model.model.layers[0].mlp.experts.quant_method is not None
