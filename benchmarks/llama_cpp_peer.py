"""The llama.cpp peer of C1 (DESIGN.md section 5): llama-cpp-python on the embedded SmolLM2 GGUF.

Same file as corectl serves, random token-id prompts (seed 0), EOS ignored, greedy, `--threads`
threads. Prints one JSON line: the batch-1 decode rate from llama.cpp's own timings (prompt eval
excluded) and the end-to-end rate. Runs in the cache venv that `cpu_bench.sh` builds (llama.cpp is
not a corectl dependency); corectl itself is only read for the path of the embedded GGUF, passed in.

  python benchmarks/llama_cpp_peer.py --gguf PATH --input-len 32 --output-len 128 --threads 2
"""
from __future__ import annotations

import argparse
import json
import random
import time

import llama_cpp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", required=True)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=3)
    args = p.parse_args()
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False)
    rng = random.Random(0)
    vocab = llm.n_vocab()
    rates, tpots = [], []
    for i in range(args.num_iters + 1):
        prompt = [rng.randrange(100, vocab - 1) for _ in range(args.input_len)]
        llm.reset()
        start = time.perf_counter()
        first = None
        n = 0
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            n += 1
            if n == args.output_len:
                break
        end = time.perf_counter()
        if i:  # the first run warms up
            tpots.append((end - first) / (n - 1))
            rates.append(n / (end - start))
    tpots.sort()
    print(json.dumps({"engine": "llama.cpp", "version": llama_cpp.__version__, "threads": args.threads,
                      "input_len": args.input_len, "output_len": args.output_len,
                      "tpot_ms_median": 1000 * tpots[len(tpots) // 2], "decode_tok_s": 1 / tpots[len(tpots) // 2],
                      "e2e_tok_s": sum(rates) / len(rates)}))


if __name__ == "__main__":
    main()
