#!/usr/bin/env bash
# Several device_bench.sh runs at once in one device call, each lane on GPUs of its own:
#   bash benchmarks/device_lanes.sh "0:tests w11 w11:gv images" "1,2:w13 w12" "3:hosttier f1 f1:asc2"
# A lane is GPUS:STAGES; its stages run in order with CUDA_VISIBLE_DEVICES=GPUS. Lanes share the
# host's CPU cores (64 on nvidia-h100-x4) and nothing else, and use disjoint ports (each stage has
# its own). Each comparison in a figure still runs within one stage, both sides on the same GPUs.
# corectl is installed once, before the lanes start; lane N's log is $OUT/laneN.log and its
# results $OUT/results-N.tgz. LANE_TIMEOUT (seconds, default 560) stops every lane, so the summary
# below still prints inside the device call's limit.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=device_bench.sh
source benchmarks/device_bench.sh
setup
export CORECTL_BENCH_READY=1
lane=0
pids=()
for spec in "$@"; do
  lane=$((lane + 1))
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=${spec%%:*} LANE=$lane timeout "${LANE_TIMEOUT:-560}" bash benchmarks/device_bench.sh ${spec#*:} > "$OUT/lane$lane.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
# Again here: a lane stopped by LANE_TIMEOUT mid-stage packed nothing of that stage.
for n in $(seq "$lane"); do tar czf "$OUT/results-$n.tgz" -C "/tmp/corectl-results-$n" . 2>/dev/null; done
for log in "$OUT"/lane*.log; do echo "##### $log"; grep -vE "^\s*$" "$log" | tail -45; done
