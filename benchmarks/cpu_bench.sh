#!/usr/bin/env bash
# C1 and C2 (DESIGN.md section 5) on this machine's CPU, corectl and its transformers peer in one run:
#   bash benchmarks/cpu_bench.sh [OUT_DIR]
# C1: batch-1 decode; C2: 16 concurrent requests. SmolLM2-135M (the embedded model), random
# token-id prompts of 32 tokens, 128 new tokens, EOS ignored: served from its 4-bit Q4_1 blocks (the
# default: no --dtype, compute dtype from the CPU's instruction set), then dequantized in bf16; the
# transformers peer in fp32 and bf16. The CPU model and bf16 flags are printed first.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.bench}"
mkdir -p "$out"
lscpu | grep -E "Model name"; grep -o -E "avx512_bf16|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
common=(--input-len 32 --output-len 128 --max-model-len 1024 --kv-cache-memory 0.5 --seed 0)
corectl bench latency --batch-size 1 --num-iters 3 "${common[@]}" --save-result "$out/c1_4bit.json"
corectl bench throughput --num-prompts 16 "${common[@]}" --save-result "$out/c2_4bit.json"
corectl bench latency --batch-size 1 --num-iters 3 --dtype bfloat16 "${common[@]}" --save-result "$out/c1.json"
corectl bench throughput --num-prompts 16 --dtype bfloat16 "${common[@]}" --save-result "$out/c2.json"
for dtype in float32 bfloat16; do
  python benchmarks/hf_peer_cpu.py --batch 1 16 --input-len 32 --output-len 128 --dtype $dtype | tee "$out/hf_peer_$dtype.jsonl"
done
