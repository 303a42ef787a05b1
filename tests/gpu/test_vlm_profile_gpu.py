"""A vision-language model's memory profile holds on a GPU: steps that encode a whole encoder
budget of large distinct images, while the encoder cache fills and evicts, keep torch's peak
allocation within the memory the profile planned (`gpu_memory_utilization` of the device less
what torch does not manage). Without the vision tower's activations and the encoder cache in the
profile, the KV cache takes their room and the peak passes the plan: here the tower's activations
for two images (32,768 patches at width 1280) outweigh the 2-layer language model's for the step."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

UTILIZATION = 0.3
# 1792 x 1792 pixels: 128 x 128 patches of 14 px, 64 x 64 = 4,096 rows after the 2 x 2 merge; a
# step of 8,192 tokens encodes two of them; 16 images overflow the 16,384-row encoder cache.
IMAGE_SIDE, NUM_IMAGES, STEP_TOKENS = 1792, 16, 8192


def _wide_qwen2_5_vl(folder):
    """Config and processor only (weights: `load_format="dummy"`): a 2-layer language model of
    width 2048 behind Qwen2.5-VL-7B's vision tower shape, 4 blocks deep, and its processor
    (up to 12,845,056 pixels an image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]},
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        vision_config=dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[3], hidden_act="silu"),
        image_token_id=31000, video_token_id=31001, vision_start_token_id=31002, vision_end_token_id=31003,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(folder)
    return folder


def test_steps_encoding_a_budget_of_distinct_images_stay_within_the_profiled_plan(tmp_path):
    from corectl import LLM, SamplingParams
    from corectl.multimodal.processors import image_processing_for
    from support.vision_models import random_image

    folder = _wide_qwen2_5_vl(tmp_path)
    llm = LLM(str(folder), load_format="dummy", platform="cuda", gpu_memory_utilization=UTILIZATION,
              max_model_len=4608, max_num_batched_tokens=STEP_TOKENS, enforce_eager=True)
    worker = llm.engine.executor.worker
    free, total = torch.cuda.mem_get_info()
    planned = total * UTILIZATION - ((total - free) - torch.cuda.memory_reserved())
    processing = image_processing_for(folder, worker.source.hf_config)
    prompts = [processing.prompt([100 + i, 200, 300, processing.placeholder_id],
                                 [random_image(IMAGE_SIDE, IMAGE_SIDE, seed=i)]) for i in range(NUM_IMAGES)]
    visual = worker.runner.multimodal.model.visual
    patches_per_call = []
    forward = visual.forward
    visual.forward = lambda pixels, grids: patches_per_call.append(pixels.shape[0]) or forward(pixels, grids)
    torch.cuda.reset_peak_memory_stats()
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    peak = torch.cuda.max_memory_allocated()
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * NUM_IMAGES
    assert max(patches_per_call) == 2 * 128 * 128  # some step encoded two whole images at once
    assert sum(patches_per_call) == NUM_IMAGES * 128 * 128
    assert peak <= planned, f"peak {peak / 2**30:.2f} GiB over the planned {planned / 2**30:.2f} GiB"
    del llm, worker, visual
    gc.collect()
    torch.cuda.empty_cache()
