"""Small random-weight vision-language checkpoints of real transformers config classes, with the
SmolLM2 tokenizer (plus the models' image tokens), a chat template that writes an image's
placeholder, and the model's published image processor configured for small images."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Qwen2-VL's template, trimmed to text and image parts (the real one also renders videos).
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_qwen2_5_vl(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2.5-VL (hidden 64; a 2-block tower of width 32 with windows of 2 x 2 merged
    tokens and one full-attention block) whose processor keeps images between 56 x 56 and 112 x 112."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    vocab_size, ids = _save_tokenizer(folder, tokenizer_dir, QWEN_VL_TOKENS, QWEN_VL_TEMPLATE)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=1, eos_token_id=2)
    config.text_config.initializer_range = 0.5
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(folder)
    return folder


def _save_tokenizer(folder: Path, tokenizer_dir: Path, tokens: list[str], template: str) -> tuple[int, dict[str, int]]:
    """The text model's tokenizer with a VLM's special `tokens` and chat `template`, saved in
    `folder`; its vocabulary size and the new tokens' ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return len(tokenizer), dict(zip(tokens, tokenizer.convert_tokens_to_ids(tokens)))


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """`data` as a base64 data URL, as an OpenAI client sends an image."""
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


# Gemma 3's template, trimmed to user turns of text and image parts.
GEMMA3_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<start_of_image>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]


def build_gemma3(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma 3 (hidden 64, a sliding layer of window 8 and a global one) with a 2-layer
    SigLIP tower on 32 x 32 images of 8 x 8 patches, one token per patch: 16 per image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    vocab_size, ids = _save_tokenizer(folder, tokenizer_dir, GEMMA3_TOKENS, GEMMA3_TEMPLATE)
    config = Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=vocab_size,
                         max_position_embeddings=512, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=16, image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config.initializer_range = config.text_config.initializer_range = 0.5
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    # transformers starts the projection at zeros, which would leave images without any effect.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    model.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def hf_greedy_with_images(model, ids: torch.Tensor, image_inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (`ids`, [1, T]) with its processor's image
    inputs (none for a text-only prompt)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **image_inputs)
    return out[0, ids.shape[1]:].tolist()
