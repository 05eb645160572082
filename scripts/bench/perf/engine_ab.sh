#!/usr/bin/env bash
# Paired before/after engine step A/B (ab_steps.py) over the decode and prefill scenarios of
# issue #8's CPU work, REPEATS times; one JSON line per scenario and repeat, to OUT_FILE.
# BEFORE_ROOT / AFTER_ROOT each hold a pdserve/ package tree. Take the bench lock:
#   flock /work/notes/bench.lock scripts/bench/perf/engine_ab.sh BEFORE AFTER OUT [REPEATS]
set -euo pipefail
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=$3 repeats=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
py=$(cd "$here/../../.." && pwd)/.venv/bin/python
echo "# start $(date -u +%FT%TZ) load $(cat /proc/loadavg)" | tee -a "$out"
for rep in $(seq 1 "$repeats"); do
  for spec in "1x1024 24 10" "1x4096 24 10" "8x1024 16 8" "32x1024 12 6" "p1024 16 1" "p4096 10 1"; do
    read -r sc rounds steps <<< "$spec"
    "$py" "$here/ab_steps.py" "$before" "$after" "$sc" --rounds "$rounds" --steps "$steps" \
      --chunk 2048 | tee -a "$out"
  done
done
echo "# end $(date -u +%FT%TZ) load $(cat /proc/loadavg)" | tee -a "$out"
