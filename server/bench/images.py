"""`corectl bench images`: prompts holding one image each against text-only prompts of the same
token count, offline, with the same output length (`ignore_eos`).

The issue's H100 workload: a Qwen2.5-VL-7B-shaped folder (its config.json and
preprocessor_config.json, `--load-format dummy`), 64 prompts with a 1024 x 1024 image and 128 output
tokens. Images are seeded random pixels; `--distinct-images N` cycles the prompts through N images,
so with N below the prompt count the encoder cache (and the prefix cache) serve the repeats. Prompts
are token ids (random text ids, then the image's placeholders), so the folder needs no tokenizer.
"""
from __future__ import annotations

import argparse
import random
import time

from ..cli.engine_args import add_engine_args, config_from_args
from .offline import llm_from_config
from .report import percentile


def register(sub) -> None:
    p = sub.add_parser("images", help="prompts with an image vs text-only prompts of the same length "
                                      "(vision-language models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--image-size", type=int, default=1024, help="width and height of each image")
    p.add_argument("--text-len", type=int, default=32, help="random text tokens before each image")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--distinct-images", type=int, default=0, help="images the prompts cycle through (0: one each)")
    p.add_argument("--passes", type=int, default=2, help="timed passes of each kind, alternating")
    add_engine_args(p)
    p.set_defaults(handler=run_images)


def run_images(args: argparse.Namespace) -> int:
    from corectl import SamplingParams
    from corectl.multimodal.processors import image_processing_for

    llm = llm_from_config(config_from_args(args))
    source = llm.engine.source
    processing = image_processing_for(source.model_dir, source.hf_config)
    if processing is None:
        print(f"{llm.engine.info.architecture} reads no images")
        return 2
    image_prompts = _image_prompts(processing, args)
    rng = random.Random(1)
    text_prompts = [[rng.randrange(1000, 20000) for _ in p["prompt_token_ids"]] for p in image_prompts]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(text_prompts[:2], params, use_tqdm=False)  # warm up
    for index in range(args.passes):
        for name, prompts in (("text", text_prompts), ("image", image_prompts)):
            _report(f"pass {index + 1} {name}", llm, prompts, params)
    return 0


def _image_prompts(processing, args: argparse.Namespace) -> list[dict]:
    import numpy as np
    from PIL import Image

    distinct = args.distinct_images or args.num_prompts
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
              for _ in range(distinct)]
    ids = random.Random(0)
    prompts = []
    for i in range(args.num_prompts):
        text = [ids.randrange(1000, 20000) for _ in range(args.text_len)]
        prompts.append(processing.prompt([*text, processing.placeholder_id], [images[i % distinct]]))
    return prompts


def _report(label: str, llm, prompts: list, params) -> None:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    prompt_len = len(outs[0].prompt_token_ids)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{label}: {len(outs)} prompts x {prompt_len} tokens in / {params.max_tokens} out in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} output tok/s, TTFT mean {sum(ttft) / len(ttft) * 1e3:.1f} ms, "
          f"p50 {percentile(ttft, 50) * 1e3:.1f} ms, p90 {percentile(ttft, 90) * 1e3:.1f} ms")
