"""Qwen2.5-VL end to end on a tiny random-weight checkpoint: greedy parity with transformers for
one and two images batched with a text-only request, with prefill chunks that split images; the
encoder cache; prefix caching that never matches another image."""
from __future__ import annotations

import pytest
import torch
from support.vision_models import data_url, hf_greedy_with_images, png_bytes, random_image

from corectl import LLM, SamplingParams

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def llm(qwen2_5_vl_dir):
    # 8-token steps: every image's 12-16 placeholders are split across chunks.
    return LLM(str(qwen2_5_vl_dir), dtype="float32", platform="cpu", kv_cache_memory_gib=0.02, max_model_len=256,
               max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def hf(qwen2_5_vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_dir, dtype=torch.float32).eval()
    return model, Qwen2VLImageProcessorPil.from_pretrained(qwen2_5_vl_dir)


def _hf_greedy(hf, prompt_ids: list[int], images) -> list[int]:
    model, processor = hf
    ids = torch.tensor([prompt_ids])
    extra = {}
    if images:
        pixels = processor(images=images, return_tensors="pt")
        extra = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                     mm_token_type_ids=(ids == model.config.image_token_id).int())
    return hf_greedy_with_images(model, ids, extra, MAX_TOKENS)


def _user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p}
               for p in parts]
    return [{"role": "user", "content": content}]


def _runner(llm):
    return llm.engine.executor.worker.runner


def test_greedy_parity_with_transformers_one_and_two_images_batched_with_text(llm, hf):
    first, second = random_image(100, 70, 1), random_image(60, 90, 2)
    url = data_url(png_bytes(first))
    conversations = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "What is this?"}]}],
        _user(first, "and", second, "Compare them."),
        [{"role": "user", "content": "Just text."}],
    ]
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    for out, images in zip(outs, [[first], [first, second], []]):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, list(out.prompt_token_ids), images)
    # The images decide the answer: the same words with another image answer otherwise.
    other = llm.chat(_user(random_image(100, 70, 7), "What is this?"),
                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)[0]
    assert other.outputs[0].token_ids != outs[0].outputs[0].token_ids


@pytest.mark.slow
def test_two_pipeline_stages_match_transformers(qwen2_5_vl_dir, hf):
    """The first stage encodes the images and merges their rows; both compute M-RoPE's positions for
    their layers. 8-token steps split the images across chunks."""
    staged = LLM(str(qwen2_5_vl_dir), dtype="float32", platform="cpu", kv_cache_memory_gib=0.02, max_model_len=256,
                 max_num_batched_tokens=8, pipeline_parallel_size=2)
    first, second = random_image(100, 70, 1), random_image(60, 90, 2)
    try:
        outs = staged.chat([_user(first, "What is this?"), _user(first, "and", second, "Compare them.")],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    finally:
        staged.engine.executor.shutdown()
    for out, images in zip(outs, [[first], [first, second]]):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, list(out.prompt_token_ids), images)


def test_a_repeated_image_is_encoded_once_and_hits_the_prefix_cache_another_image_does_not(llm):
    image, other = random_image(96, 96, 3), random_image(96, 96, 4)
    system = {"role": "system", "content": "You describe pictures carefully and in a few words, always."}
    params = SamplingParams(max_tokens=2, temperature=0)
    cache = _runner(llm).multimodal.cache
    first = llm.chat([system, *_user(image, "Describe.")], params, use_tqdm=False)[0]
    misses = cache.misses
    again = llm.chat([system, *_user(image, "Describe.")], params, use_tqdm=False)[0]
    assert cache.misses == misses  # no image encoded: the prefix cache or the encoder cache served it
    swapped = llm.chat([system, *_user(other, "Describe.")], params, use_tqdm=False)[0]
    image_token = llm.engine.info.image_token_id
    offset = list(first.prompt_token_ids).index(image_token)
    block = llm.config.block_size
    assert again.num_cached_tokens > offset
    assert 0 < swapped.num_cached_tokens <= offset // block * block
    assert cache.misses == misses + 1


def test_the_scheduler_decides_what_the_encoder_cache_holds(llm):
    """Requests repeating a finished request's image prompt, whose prefix hits end inside the
    image, read its rows from the worker's encoder cache; once the scheduler's manager evicts the
    image (the worker drops it too), such a prefix hit encodes it again, and greedy tokens equal
    the cold run's."""
    from corectl.multimodal.inputs import content_hash
    from corectl.multimodal.processors import image_processing_for

    image = random_image(96, 96, 11)
    conversation = [{"role": "system", "content": "Be brief."}, *_user(image, "Describe.")]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    processed = image_processing_for(llm.engine.source.model_dir, llm.engine.source.hf_config).process(image)
    key = content_hash(processed.pixels, processed.grid_thw)
    cache, manager = _runner(llm).multimodal.cache, llm.engine.scheduler.encoder_cache
    cold = llm.chat(conversation, params, use_tqdm=False)[0]
    assert key in manager and key in cache and manager.is_idle(key)
    misses = cache.misses
    repeats = llm.chat([conversation] * 3, params, use_tqdm=False)
    offset = list(cold.prompt_token_ids).index(llm.engine.info.image_token_id)
    assert all(offset < out.num_cached_tokens < offset + processed.num_tokens for out in repeats)
    assert cache.misses == misses  # encoded once, by the cold run
    assert all(out.outputs[0].token_ids == cold.outputs[0].token_ids for out in repeats)
    # Room for one image: another image's request evicts this one, in the scheduler and the worker.
    capacity, manager.capacity_rows = manager.capacity_rows, processed.num_tokens
    try:
        llm.chat(_user(random_image(96, 96, 12), "Other."), params, use_tqdm=False)
    finally:
        manager.capacity_rows = capacity
    assert key not in manager and key not in cache
    again = llm.chat(conversation, params, use_tqdm=False)[0]
    assert offset < again.num_cached_tokens < offset + processed.num_tokens
    assert cache.misses == misses + 2  # the other image, then this one again
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_graph_positions_are_the_eager_steps_positions_wherever_a_graph_may_replay(llm, monkeypatch):
    """Decode CUDA graphs take one position row: wherever `graph_positions` offers one, all three
    M-RoPE rows of the eager step equal it (an image request's decode positions sit at index +
    offset), and no step that merges image rows is offered one."""
    step = _runner(llm).multimodal
    prepare, seen = step.prepare, []

    def watched(host, input_ids, positions, states, embeds=True):
        offered = step.graph_positions(host, states)
        embeds, used = prepare(host, input_ids, positions, states, embeds)
        seen.append((offered, embeds is not None, used.cpu().numpy()))
        return embeds, used

    monkeypatch.setattr(step, "prepare", watched)
    llm.chat([_user(random_image(100, 70, 5), "Describe it."), [{"role": "user", "content": "Text."}]],
             SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert any(merged for _, merged, _ in seen) and any(offered is None for offered, _, _ in seen)
    offered = [(rows, used) for rows, merged, used in seen if rows is not None and not merged]
    assert len(offered) == sum(rows is not None for rows, _, _ in seen), "a step merging image rows was offered a graph"
    assert any(used.ndim == 2 for _, used in offered), "no decode step of the image request was offered a graph"
    for rows, used in offered:
        assert ((used if used.ndim == 2 else used[None]) == rows).all()


def test_text_only_model_refuses_images(llm_int4):
    from corectl.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="reads no images"):
        llm_int4.chat(_user(random_image(8, 8, 0), "Hi"), SamplingParams(max_tokens=1), use_tqdm=False)


def test_three_position_rows_never_reach_a_backends_fused_rotation(llm, monkeypatch):
    """A backend that fuses the rotation into its cache write (the Triton one, in decode steps)
    takes one position row: M-RoPE's three rows rotate in the layer, one row is deferred."""
    from types import SimpleNamespace

    from corectl.backends.triton.layer_kernels import triton_layer_kernels
    from corectl.models.qwen2_5_vl import MRotaryEmbedding

    rotary = next(m for m in _runner(llm).model.modules() if isinstance(m, MRotaryEmbedding))
    monkeypatch.setattr(rotary, "kernels", triton_layer_kernels())
    ctx = SimpleNamespace(backend=SimpleNamespace(fuses_rotary=lambda metadata: True), metadata=None)
    assert rotary.deferred(torch.zeros(3, 4, dtype=torch.int64), ctx) is None
    one_row = rotary.deferred(torch.arange(4), ctx)
    assert one_row is not None and one_row.positions.dim() == 1 and one_row.cos is rotary.cos


def test_transparent_pixels_go_over_white_as_transformers_composites_them():
    """An RGBA logo or screenshot: its transparent pixels are white, as transformers' convert_to_rgb and
    vLLM make them, not whatever colour they hold under an alpha of zero."""
    import numpy as np
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    from corectl.multimodal.processing import decode_image

    rng = np.random.default_rng(3)
    rgba = Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "RGBA")
    ours = np.asarray(decode_image(png_bytes(rgba), 10_000))
    assert np.array_equal(ours, np.asarray(convert_to_rgb(rgba))) and ours.shape == (20, 30, 3)
    opaque = random_image(30, 20, 4)
    assert np.array_equal(np.asarray(decode_image(png_bytes(opaque), 10_000)), np.asarray(opaque))


def test_an_image_the_processor_cannot_resize_is_the_requests_fault(llm):
    """A 2000 x 2 strip is within every size bound, but the processor refuses its aspect ratio."""
    from corectl.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="cannot be processed for this model") as err:
        llm.chat(_user(random_image(2000, 2, 5), "Describe."), SamplingParams(max_tokens=2), use_tqdm=False)
    assert err.value.param == "messages" and err.value.code == "invalid_image"
    assert llm.chat(_user(random_image(64, 64, 6), "Describe."), SamplingParams(max_tokens=2),
                    use_tqdm=False)[0].outputs[0].token_ids
