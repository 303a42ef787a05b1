"""Write a Qwen2.5-VL-7B-Instruct-shaped folder (config.json and preprocessor_config.json, no weights,
no tokenizer) for `corectl bench images --load-format dummy`: issue 29's H100 workload without the hub.

    python benchmarks/vlm_shape.py /tmp/qwen2.5-vl-7b-shape
    python benchmarks/vlm_shape.py /tmp/tiny-vl --layers 2 --vision-depth 2   (a CPU check of the bench)

The numbers are the published checkpoint's (Qwen/Qwen2.5-VL-7B-Instruct's config.json and
preprocessor_config.json); `--layers` and `--vision-depth` shorten the stacks for a quick check.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def write_shape(folder: Path, layers: int = 28, vision_depth: int = 32) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    full_attention = [i for i in (7, 15, 23, 31) if i < vision_depth] or [vision_depth - 1]
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]},
                         bos_token_id=151643, eos_token_id=151645),
        vision_config=dict(depth=vision_depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=full_attention, hidden_act="silu",
                           tokens_per_second=2),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (28 in the 7B)")
    parser.add_argument("--vision-depth", type=int, default=32, help="vision tower blocks (32 in the 7B)")
    args = parser.parse_args()
    print(write_shape(args.folder, args.layers, args.vision_depth))


if __name__ == "__main__":
    main()
