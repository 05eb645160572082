#!/usr/bin/env bash
# A/B of a change in one locked run: /tmp/wt-before and /tmp/wt-after are git worktrees (before,
# after); same sweep, code order alternating per round. flock /work/notes/bench.lock <this>
set -u
OUT=/work/main/results/midstep/b
PY=/work/main/.venv/bin/python
echo "start $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
for round in 1 2 3; do
  for code in $([ $((round % 2)) = 1 ] && echo "before after" || echo "after before"); do
    echo "== round $round $code $(date -u +%T) load $(cat /proc/loadavg)"
    (cd /tmp/wt-$code && PYTHONPATH=/tmp/wt-$code timeout 600 $PY -m pdserve bench sweep \
      --input-len 1024 --request-rate 2 --modes pull push --output-len 128 --num-prompts 32 \
      --model /work/main/results/ckpt-qwen3-4l256 --transport tcp --seed 0 --interleave \
      --out-dir $OUT/r$round-$code --disable-tqdm -- --dtype float32 --kv-cache-memory 1 2>&1 | tail -12)
  done
done
echo "end $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
