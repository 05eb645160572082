#!/bin/bash
# pdserve pull / push / monolithic on the random Qwen3 checkpoint, at the field notes' points.
# Usage: run_vs_vllm.sh OUT_DIR "ONE_AT_A_TIME_LENS" "LEN:RATE ..." [NUM_PROMPTS]
# The clusters stay up for the whole run (interleaved modes, rotating order per point).
# MODES (default "pull push monolithic") may add mono1: the monolithic instance on P's one
# core with one torch thread, i.e. the same compute P has (the light-load TTFT baseline).
# DTYPE (default float32) is every instance's --dtype.
set -u
cd "$(dirname "$0")/../../.."  # the repo root: OUT_DIR and MODEL are relative to it
OUT=$1; C1_LENS=$2; LOADED=$3; N=${4:-32}
MODEL=${MODEL:-results/ckpt-qwen3-4l256}
PY=.venv/bin/python
mkdir -p $OUT
echo "start $(date -u +%FT%TZ) $(cat /proc/loadavg)" | tee -a $OUT/log.txt
(while true; do echo "$(date -u +%T) $(cat /proc/loadavg)" >> $OUT/load.txt; sleep 30; done) &
LOADPID=$!
read -r -a MODE_LIST <<< "${MODES:-pull push monolithic}"
NM=${#MODE_LIST[@]}
declare -A PORT=([pull]=18110 [push]=18120 [monolithic]=18130 [mono1]=18140)
PIDS=()
for mode in "${MODE_LIST[@]}"; do
  pre=(); extra=()
  case $mode in
    monolithic) flag=--monolithic ;;
    mono1) flag="--monolithic --no-pin"; pre=(taskset -c 0); extra=(--threads 1) ;;
    *) flag="--kv-transfer $mode" ;;
  esac
  "${pre[@]}" $PY -m pdserve up $flag --model $MODEL --port ${PORT[$mode]} \
      --log-dir $OUT/logs-$mode -- --dtype ${DTYPE:-float32} --kv-cache-memory 1 "${extra[@]}" \
      > $OUT/up-$mode.txt 2>&1 &
  PIDS+=($!)
done
for mode in "${MODE_LIST[@]}"; do
  for i in $(seq 120); do grep -q "ready" $OUT/up-$mode.txt && break; sleep 1; done
  grep -q ready $OUT/up-$mode.txt || { echo "$mode did not start"; cat $OUT/up-$mode.txt; }
done
rot=0
run_point() {  # len rate conc label
  local i m
  for ((i = 0; i < NM; i++)); do
    m=${MODE_LIST[$(( (i + rot) % NM ))]}
    $PY -m pdserve bench serve --base-url http://127.0.0.1:${PORT[$m]} --input-len $1 \
      --output-len 64 --num-prompts $N --request-rate $2 $3 --seed 0 --num-warmups 2 \
      --ignore-eos --disable-tqdm --label $m --save-result $OUT/$4-$m.json > $OUT/$4-$m.txt 2>&1
    echo "$(date -u +%T) $4 $m rc=$? load $(cut -d' ' -f1 /proc/loadavg)" | tee -a $OUT/log.txt
  done
  rot=$((rot + 1))
}
for L in $C1_LENS; do run_point $L inf "--max-concurrency 1" "in${L}-c1"; done
for p in $LOADED; do run_point ${p%:*} ${p#*:} "" "in${p%:*}-r${p#*:}"; done
for pid in "${PIDS[@]}"; do kill -TERM $pid; done
for pid in "${PIDS[@]}"; do wait $pid; done
kill $LOADPID
echo "end $(date -u +%FT%TZ) $(cat /proc/loadavg)" | tee -a $OUT/log.txt
