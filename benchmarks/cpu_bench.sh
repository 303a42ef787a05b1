#!/usr/bin/env bash
# C1 and C2 (DESIGN.md section 5, issue 30) on this machine's CPU: corectl, llama.cpp and transformers
# in one run, on the embedded SmolLM2-135M Q4_1 GGUF:
#   bash benchmarks/cpu_bench.sh [OUT_DIR]        (THREADS=2 by default)
# C1: batch-1 decode; C2: 16 concurrent requests. Random token-id prompts of 32 tokens, 128 new
# tokens, EOS ignored. corectl: the default (4-bit Q4_1 layers and the Q8_0 head as int8 groups, fp32
# around them), then dequantized in fp32 and bf16 (`--dtype`); llama.cpp (C1): llama-cpp-python built
# from PyPI's source package for this CPU, once, into a cache venv outside corectl's dependencies
# (about 4+ minutes on 2 cores); transformers in fp32 (and bf16 for reference). Prints the CPU
# model and flags and the load average first: on a shared machine, read the figures as under load.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.bench}"
threads="${THREADS:-2}"
mkdir -p "$out"
lscpu | grep -E "^(Model name|Flags)"
echo "load: $(uptime)"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

peer="${CORECTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/corectl}/bench/llama-venv"
if [ ! -x "$peer/bin/python" ] || ! "$peer/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python -m venv "$peer"
  # The CPU's vector extensions by name, not -march=native: a native build on a KVM guest listing AMX
  # died with an illegal instruction (2026-11-27); llama.cpp's AMX path is left out.
  flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
  for ext in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI; do
    grep -qw "${ext%%:*}" /proc/cpuinfo && flags+=("-DGGML_${ext#*:}=ON")
  done
  CMAKE_ARGS="${flags[*]}" "$peer/bin/pip" install --no-cache-dir --no-binary llama-cpp-python llama-cpp-python
fi
gguf=$(python -c "from corectl.config import EngineConfig; from corectl.loaders import resolve_model_source; print(resolve_model_source(EngineConfig()).gguf_file)")

common=(--input-len 32 --output-len 128 --max-model-len 1024 --kv-cache-memory 0.5 --seed 0 --num-threads "$threads")
echo "C1 llama.cpp; load: $(uptime)"
"$peer/bin/python" benchmarks/llama_cpp_peer.py --gguf "$gguf" --input-len 32 --output-len 128 \
  --threads "$threads" | tee "$out/c1_llama_cpp.jsonl"
for dtype in auto float32 bfloat16; do
  echo "C1/C2 corectl --dtype $dtype; load: $(uptime)"
  corectl bench latency --batch-size 1 --num-iters 3 --dtype "$dtype" "${common[@]}" --save-result "$out/c1_$dtype.json"
  corectl bench throughput --num-prompts 16 --dtype "$dtype" "${common[@]}" --save-result "$out/c2_$dtype.json"
done
for dtype in float32 bfloat16; do
  echo "C1/C2 transformers $dtype; load: $(uptime)"
  OMP_NUM_THREADS="$threads" python benchmarks/hf_peer_cpu.py --batch 1 16 --input-len 32 --output-len 128 \
    --dtype $dtype | tee "$out/hf_peer_$dtype.jsonl"
done
echo "done; load: $(uptime)"
