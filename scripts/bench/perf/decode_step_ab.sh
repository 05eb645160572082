#!/usr/bin/env bash
# Wall and thread-CPU ms per decode step of two pdserve trees, alternated per round
# (scripts/bench/perf/decode_step.py; the model is the 4-layer Qwen3 checkpoint).
# usage: decode_step_ab.sh BEFORE_ROOT AFTER_ROOT OUT_FILE [ROUNDS]   (take the bench lock)
set -euo pipefail
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=$3 rounds=${4:-5}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    root=${!side}
    for spec in "1 400" "8 80"; do
      read -r batch steps <<< "$spec"
      line=$(PYTHONPATH=$root "$repo/.venv/bin/python" "$repo/scripts/bench/perf/decode_step.py" \
        "$repo/results/ckpt-qwen3-4l256" "$batch" "$steps")
      echo "$(date -u +%T) r$r $side $line load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out"
    done
  done
done
