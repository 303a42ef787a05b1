"""The transformers peer for the CPU workloads C1 and C2 (DESIGN.md section 5), on the embedded model.

Same weights as corectl (the safetensors folder corectl converts the SmolLM2 GGUF into), same prompts
shape (random token ids, seed 0), EOS ignored. Prints one JSON line per measurement.

  python benchmarks/hf_peer_cpu.py --batch 1 16 --input-len 32 --output-len 128 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from corectl.config import EngineConfig
from corectl.loaders import resolve_model_source


def _generate(model, prompts: torch.Tensor, new_tokens: int) -> float:
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    folder = resolve_model_source(EngineConfig()).model_dir
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    for batch in args.batch:
        prompts = torch.tensor([[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(batch)])
        _generate(model, prompts[:, :8], 4)
        prefill = _generate(model, prompts, 1)
        total = _generate(model, prompts, args.output_len)
        decode_tps = batch * (args.output_len - 1) / (total - prefill)
        print(json.dumps({"peer": "transformers", "version": __import__("transformers").__version__,
                          "dtype": args.dtype, "batch": batch, "input_len": args.input_len,
                          "output_len": args.output_len, "threads": torch.get_num_threads(),
                          "output_tok_s": round(batch * args.output_len / total, 1),
                          "decode_tok_s": round(decode_tps, 1)}), flush=True)


if __name__ == "__main__":
    main()
