"""The memory profile of a vision-language model: the worst-case encoder batch of one step (the
encoder budget filled with the largest images the processor admits), encoded through the tower
and held while the text dummy step runs; the encoder cache reserved outside the KV cache."""
from __future__ import annotations

import pytest

from corectl import LLM
from corectl.kv.sizing import profiled_kv_blocks
from corectl.multimodal.budget import ENCODER_CACHE_ROWS
from corectl.multimodal.profile import worst_case_images

# Tiny Qwen2.5-VL (tests/support/vision_models.py): 56 x 56 to 112 x 112 pixels in 28-pixel cells,
# a square of 2 x 2 to 4 x 4 cells, 4 to 16 rows; 42 rows a step: two of 16, one of 3 x 3 cells, and
# no image of one row exists.
BUDGET = 42


@pytest.fixture(scope="module")
def qwen_worker(qwen2_5_vl_dir):
    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", platform="cpu", kv_cache_memory_gib=0.01, max_model_len=64,
              max_num_batched_tokens=BUDGET)
    return llm.engine.executor.worker


def test_worst_case_fills_the_encoder_budget_with_the_largest_images_first(qwen2_5_vl_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(qwen2_5_vl_dir)
    images = worst_case_images(config, qwen2_5_vl_dir, BUDGET, max_model_len=64)
    assert [item.length for item in images] == [16, 16, 9]
    assert [item.grid_thw for item in images] == [[1, 8, 8]] * 2 + [[1, 6, 6]]
    # One row of 3 x 2 x 14 x 14 values per patch, as the processor lays them out.
    assert [item.pixel_shape for item in images] == [[64, 1176]] * 2 + [[36, 1176]]
    assert len({item.hash for item in images}) == 3
    # No prompt holds an image longer than the context: the largest one left is 3 x 3 cells.
    assert [item.length for item in worst_case_images(config, qwen2_5_vl_dir, 20, max_model_len=9)] == [9, 9]
    # An image larger than the budget runs alone.
    assert [item.length for item in worst_case_images(config, qwen2_5_vl_dir, 8, max_model_len=64)] == [16]


def test_gemma3_worst_case_is_whole_squares_and_none_without_a_processor(tmp_path):
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    config = Gemma3Config(text_config=dict(hidden_size=64), mm_tokens_per_image=16,
                          vision_config=dict(hidden_size=32, image_size=32, patch_size=8))
    assert worst_case_images(config, tmp_path, 40, max_model_len=64) == []
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    images = worst_case_images(config, tmp_path, 40, max_model_len=64)
    assert [(item.length, item.pixel_shape) for item in images] == [(16, [1, 3, 32, 32])] * 2
    assert worst_case_images(config, tmp_path, 40, max_model_len=15) == []


def test_dummy_step_inside_the_worst_case_encoding_runs_the_tower_once_and_leaks_nothing(qwen_worker, monkeypatch):
    visual = qwen_worker.runner.multimodal.model.visual
    calls = []
    forward = visual.forward
    monkeypatch.setattr(visual, "forward", lambda pixels, grids: calls.append(pixels.shape[0]) or forward(pixels, grids))
    cache = qwen_worker.runner.multimodal.cache
    with qwen_worker.worst_case_encoding() as encoded:
        held = encoded.outputs
        assert [tuple(rows.shape) for rows in held] == [(16, 64)] * 2 + [(9, 64)]
        qwen_worker.run_dummy_step(BUDGET, 2)
        assert len(held) == 3  # alive while the language model ran
    assert calls == [64 + 64 + 36]  # one batch, every patch of the three images
    assert held == [] and encoded.rows == 41
    assert encoded.cache_bytes == ENCODER_CACHE_ROWS * 64 * 4  # fp32 rows of the text width
    assert not any(item.hash in cache for item in encoded.images)


def test_a_text_only_model_encodes_nothing(llm_int4):
    worker = llm_int4.engine.executor.worker
    assert worker.runner.multimodal is None
    with worker.worst_case_encoding() as encoded:
        assert encoded is None


def test_kv_blocks_leave_room_for_the_encoder_cache():
    gib = 1 << 30
    # 10 GiB at 0.9: 9 GiB less 4 GiB of peak and 1 GiB outside torch leaves 4 GiB of 1 MiB blocks.
    assert profiled_kv_blocks(10 * gib, 0.9, 4 * gib, 1 * gib, 1 << 20) == 4096
    assert profiled_kv_blocks(10 * gib, 0.9, 4 * gib, 1 * gib, 1 << 20, reserved_bytes=gib // 2) == 3584
    assert profiled_kv_blocks(10 * gib, 0.9, 4 * gib, 1 * gib, 1 << 20, reserved_bytes=5 * gib) < 0
