#!/usr/bin/env bash
# Decode-step A/B of two pdserve trees (issue 8): `pdserve bench engine` on each tree,
# alternated per round so both sides see the same machine load.
#
# usage: decode_ab.sh BEFORE_ROOT AFTER_ROOT OUT_DIR [ROUNDS]
# Each ROOT holds a `pdserve/` package (e.g. a copy of the tree with some files reverted); a
# run imports it by starting `python -m pdserve` from that directory. Take the bench lock:
#   flock /work/notes/bench.lock scripts/bench/perf/decode_ab.sh ...
# Summarise with scripts/bench/perf/decode_ab_summary.py OUT_DIR.
set -euo pipefail
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=$3 rounds=${4:-3}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
py=$repo/.venv/bin/python
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    root=${!side}
    for model in "$repo/results/ckpt-qwen3-4l256" builtin:small; do
      echo "$(date -u +%T) r$r $side $(basename "$model") $(cut -d' ' -f1-3 /proc/loadavg)" \
        | tee -a "$out/load.txt"
      (cd "$root" && "$py" -m pdserve bench engine --model "$model" --batch 1 4 8 32 \
        --decode-ctx 1024 --decode-steps 64 --json) \
        > "$out/$side-r$r-$(basename "$model" | tr ':' '_').json"
    done
  done
done
