#!/usr/bin/env bash
# One device call: install corectl there, then run the named stages; logs and JSON results go to $OUT.
#   bash scripts/device_bench.sh tests kernels w3 w2        (first call)
#   bash scripts/device_bench.sh w1 w4                       (second call)
#   bash scripts/device_bench.sh quanttests w2fp8 w1fp8 w2awq (quantization: FP8 W8A8, 4-bit AWQ)
# Needs, carried: .whl (corectl's pure-Python deps missing from the device image) and .peers
# (DESIGN.md's HF peer harness, not project code). Every stage's peer runs in the same call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
RES=/tmp/corectl-results   # everything lands here, then goes back as one tarball ($OUT takes 8 files)
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$RES/install.log" 2>&1 || { cat "$RES/install.log"; exit 1; }
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'

PEER=".peers/hf_baseline.py"
bench() { corectl bench "$@" --platform cuda --load-format dummy --seed 0 --max-num-seqs 256 --max-num-batched-tokens 8192; }

stage_tests() { python3 -m pytest -q -x tests/gpu -p no:cacheprovider 2>&1 | tee "$RES/gpu_tests.log" | tail -15; }
stage_kernels() {
  python3 "$PEER" ceilings
  python3 -m corectl.backends.triton.bench_kernels 2>&1 | tail -20
}
stage_w3() {
  bench latency --model qwen3-0.6b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w3.json"
  bench latency --model qwen3-0.6b --batch-size 1 --input-len 512 --output-len 128 --no-async-scheduling --save-result "$RES/w3_sync.json"
  python3 "$PEER" static --shape qwen3-0.6b --batch 1 --input-len 512 --output-len 128
}
stage_prof3() {
  bench latency --model qwen3-0.6b --batch-size 1 --input-len 512 --output-len 128 --num-iters 1 --profile > "$RES/prof3.txt"
  grep -A40 "Python functions" "$RES/prof3.txt" | head -45; grep -A30 "operators by" "$RES/prof3.txt" | cut -c1-60,100-200 | head -34
}
stage_w2() {
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w2.json"
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --no-async-scheduling --save-result "$RES/w2_sync.json"
  python3 "$PEER" static --shape llama3-8b --batch 1 --input-len 512 --output-len 128
}
stage_w1() {
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/w1.json"
  python3 "$PEER" static --shape llama3-8b --batch 128 --input-len 512 --output-len 128
}
stage_prof1() {
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --profile > "$RES/prof1.txt"
  grep Throughput "$RES/prof1.txt"; grep -A22 "Python functions" "$RES/prof1.txt" | cut -c1-150 | tail -14
  grep -A24 "operators by" "$RES/prof1.txt" | cut -c1-60,100-200 | tail -20; grep -E "Self CUDA time total|Wall time" "$RES/prof1.txt"
}
stage_prof2() {
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --num-iters 1 --profile > "$RES/prof2.txt"
  grep TPOT "$RES/prof2.txt"; grep -A24 "operators by" "$RES/prof2.txt" | cut -c1-60,100-200 | tail -20; grep -E "Self CUDA time total|Wall time" "$RES/prof2.txt"
}
stage_w5() {
  # Online: the server with the llama3-8b shape, token-id prompts (no tokenizer), then the same
  # batch-1 shape offline, so the HTTP share of TPOT at concurrency 1 is measured in one call.
  # Default serve settings (the online token budget, server/cli_serve.py SERVE_DEFAULTS).
  corectl serve llama3-8b --load-format dummy --platform cuda --port 8011 > "$RES/w5_server.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  for c in 1 64; do
    corectl bench serve --base-url http://127.0.0.1:8011 --endpoint /v1/completions --prompt-token-ids \
      --vocab-size 128000 --input-len 1024 --output-len 128 --ignore-eos --seed 0 \
      --num-prompts $(( c == 1 ? 16 : 256 )) --max-concurrency $c --save-result "$RES/w5_c$c.json" | grep -E "Mean|P99|Median|throughput"
  done
  kill -TERM $server; wait $server
  bench latency --model llama3-8b --batch-size 1 --input-len 1024 --output-len 128 --save-result "$RES/w5_offline.json" | grep TPOT
}
stage_w5budget() {
  # Online latency against the step token budget: W5's concurrency-64 load on the llama3-8b shape, one
  # server per budget (W5_BUDGETS, default "8192 2048 1024"), each warmed up by a first pass before the
  # measured one; 8192 with 256 sequences is the setting of the earlier W5 figures.
  local port=8012
  for budget in ${W5_BUDGETS:-8192 2048 1024}; do
    local seqs=$(( budget == 8192 ? 256 : 128 ))
    corectl serve llama3-8b --load-format dummy --platform cuda --port $port --max-num-seqs $seqs \
      --max-num-batched-tokens $budget > "$RES/w5_server_$budget.log" 2>&1 &
    local server=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
    for pass in warm run; do
      local prompts=256; [ $pass = warm ] && prompts=64
      corectl bench serve --base-url http://127.0.0.1:$port --endpoint /v1/completions --prompt-token-ids \
        --vocab-size 128000 --input-len 1024 --output-len 128 --ignore-eos --seed 0 \
        --num-prompts $prompts --max-concurrency 64 \
        --save-result "$RES/w5_b${budget}_$pass.json" > "$RES/w5_b${budget}_$pass.txt" 2>&1
    done
    echo "budget $budget seqs $seqs:"; grep -iE "throughput|ITL|TTFT|TPOT|failed" "$RES/w5_b${budget}_run.txt"
    kill -TERM $server; wait $server; port=$(( port + 1 ))
  done
}
stage_w4() {
  bench throughput --model qwen3-0.6b --num-prompts 256 --min-len 100 --max-len 1024 --save-result "$RES/w4.json"
  python3 "$PEER" static --shape qwen3-0.6b --batch 128 --input-len 512 --output-len 512
}
stage_w2fp8() {
  # W2 and W1 with FP8 W8A8 weights quantized on the fly (--quantization fp8), bf16 in the same call.
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w2_fp8.json"
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w2_bf16.json"
}
stage_w1fp8() {
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w1_fp8.json"
  python3 "$PEER" static --shape llama3-8b --batch 128 --input-len 512 --output-len 128
}
stage_w2awq() {
  # W2 with 4-bit AWQ weights (group 128): random packed weights from the quantization_config override.
  local awq='{"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}}'
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --hf-overrides "$awq" --save-result "$RES/w2_awq.json"
}
stage_quanttests() { python3 -m pytest -q tests/gpu/test_gpu_quantization.py -p no:cacheprovider 2>&1 | tee "$RES/gpu_quant_tests.log" | tail -15; }

for stage in "$@"; do
  echo "=== $stage"
  start=$(date +%s)
  "stage_$stage" 2>&1 | tee "$RES/$stage.log" | grep -vE "^\s*$|it/s\]|Warning|warn\(" | tail -60
  echo "=== $stage took $(( $(date +%s) - start )) s"
done
tar czf "$OUT/results.tgz" -C "$RES" .
