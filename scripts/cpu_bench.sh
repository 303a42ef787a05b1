#!/usr/bin/env bash
# C1 and C2 (DESIGN.md section 5) on this machine's CPU, corectl and its transformers peer in one run:
#   bash scripts/cpu_bench.sh [OUT_DIR]
# C1: batch-1 decode; C2: 16 concurrent requests. SmolLM2-135M (the embedded model), bf16, random
# token-id prompts of 32 tokens, 128 new tokens, EOS ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.bench}"
mkdir -p "$out"
common=(--dtype bfloat16 --input-len 32 --output-len 128 --max-model-len 1024 --kv-cache-memory 0.5 --seed 0)
corectl bench latency --batch-size 1 --num-iters 3 "${common[@]}" --save-result "$out/c1.json"
corectl bench throughput --num-prompts 16 "${common[@]}" --save-result "$out/c2.json"
python scripts/hf_peer_cpu.py --batch 1 16 --input-len 32 --output-len 128 --dtype bfloat16 | tee "$out/hf_peer.jsonl"
