"""Llama 4 text against transformers: iRoPE (chunked local layers rotating adjacent pairs, a global
no-rope layer with attention temperature tuning), per-head L2 q/k norm, sigmoid top-1 routing that
scales expert inputs, a shared expert, dense and sparse layers; greedy fp32 through prefix hits and
preemption."""
from __future__ import annotations

import pytest
import torch
from support.arch_parity import assert_engine_matches, save_random_model
from support.new_arch_configs import LLAMA4_CHUNK, VOCAB, llama4_config


def test_llama4_greedy_matches_transformers(tmp_path, default_model_dir):
    hf_model = save_random_model(llama4_config(), tmp_path / "l4", default_model_dir, seed=8)
    llm = assert_engine_matches(tmp_path / "l4", hf_model, VOCAB)
    layers = llm.engine.executor.worker.runner.model.model.layers
    assert [layer.self_attn.attn.attention_chunk for layer in layers] == [LLAMA4_CHUNK] * 3 + [None]
    assert [type(layer.mlp).__name__ for layer in layers] == ["GatedMLP", "Llama4MoE", "GatedMLP", "Llama4MoE"]


def test_chunks_and_temperature_change_the_model(tmp_path, default_model_dir):
    """The parity above means something only if transformers' logits depend on the chunking and the
    temperature tuning at these lengths."""
    from transformers import AutoModelForCausalLM

    base = save_random_model(llama4_config(), tmp_path / "l4", default_model_dir, seed=8)
    prompt = torch.arange(3, 30)[None]
    with torch.no_grad():
        logits = base(prompt).logits[0, -1]
        for change in (dict(attention_chunk_size=4096), dict(attn_temperature_tuning=False)):
            other = AutoModelForCausalLM.from_config(llama4_config(**change), dtype=torch.float32).eval()
            other.load_state_dict(base.state_dict())
            assert (other(prompt).logits[0, -1] - logits).abs().max() > 0.1, change


def test_triton_backend_under_the_interpreter(tmp_path, default_model_dir):
    """The real CPU worker and scheduler with the Triton kernels (chunked layers) in place of SDPA."""
    from support.models import hf_greedy
    from test_sliding_window_parity import _run_triton_engine

    hf_model = save_random_model(llama4_config(), tmp_path / "l4", default_model_dir, seed=8)
    prompts = [[5 + i for i in range(n)] for n in (11, 19)]
    outputs, _, _ = _run_triton_engine(tmp_path / "l4", prompts, 6)
    for prompt, output in zip(prompts, outputs):
        assert [token for token, _ in output] == hf_greedy(hf_model, prompt, 6)[0]


def _published_layout_config():
    """Llama 4 as Scout and Maverick ship: the text model beside a (tiny) vision tower and projector."""
    from transformers import Llama4Config

    tower = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=56,
                 patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64,
                 pixel_shuffle_ratio=0.5)
    return Llama4Config(text_config=llama4_config().to_dict(), vision_config=tower, boi_token_index=VOCAB - 3,
                        eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1)


def test_a_checkpoint_with_its_vision_tower_serves_the_text_model_and_refuses_images(tmp_path, default_model_dir):
    """`Llama4ForConditionalGeneration` (tensors under `language_model.`, `vision_model.`,
    `multi_modal_projector.`): the same greedy tokens as transformers' model on text, and an image is
    refused by name, the tower being out of scope."""
    from corectl.errors import InvalidRequestError
    from support.arch_parity import copy_tokenizer
    from transformers import Llama4ForConditionalGeneration

    torch.manual_seed(8)
    hf_model = Llama4ForConditionalGeneration(_published_layout_config()).eval()
    hf_model.save_pretrained(tmp_path / "scout")
    copy_tokenizer(default_model_dir, tmp_path / "scout")
    # The reference is transformers' text model of the same weights (its multimodal forward reads
    # outputs the text model does not return, in this transformers version).
    llm = assert_engine_matches(tmp_path / "scout", hf_model.language_model, VOCAB, variant=True)
    assert llm.engine.info.architecture == "Llama4ForConditionalGeneration" and llm.engine.info.image_token_id is None
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(InvalidRequestError, match=r"this model \(Llama4ForConditionalGeneration\) reads no images"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
