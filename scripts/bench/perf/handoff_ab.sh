#!/usr/bin/env bash
# A/B of the handoff changes in one locked run: flock /work/notes/bench.lock <this> OUT ROUNDS FIRST
# /tmp/hb/ab/before: the current tree with the handoff files as at HEAD; /tmp/hb/ab/after: the
# current tree (made by handoff_ab_trees.sh). Per round, for each code (order alternating from
# FIRST): one push and one pull cluster (pdserve up, P core 0, D core 1), each running
# `serial` (one request at a time, 1024 tokens) then `rate2` (1024 tokens x 2 req/s).
set -u
OUT=$1; ROUNDS=$2; FIRST=${3:-before}
OTHER=$([ "$FIRST" = before ] && echo after || echo before)
RUN=/work/main/scripts/bench/perf/handoff_run.sh
echo "start $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for code in $([ $((round % 2)) = 1 ] && echo "$FIRST $OTHER" || echo "$OTHER $FIRST"); do
    for mode in push pull; do
      echo "== round $round $code $mode $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
      OLEN=64 NSER=40 NRATE=40 $RUN /tmp/hb/ab/$code "$mode" "$OUT/r$round-$code-$mode" serial rate2
    done
  done
done
echo "end $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
