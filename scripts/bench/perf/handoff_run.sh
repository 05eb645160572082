#!/usr/bin/env bash
# One cluster of one tree, one mode: `pdserve up` (P core 0, D core 1) + `bench serve` runs.
# usage: handoff_run.sh TREE MODE OUTDIR WORKLOADS...   (WORKLOAD: serial | rate2)
# TREE is a directory holding a `pdserve` package (PYTHONPATH and cwd select it); with
# TRACE=1 the hop trace (logger pdserve.handoff) is on in every process (sitecustomize).
set -u
TREE=$1; MODE=$2; OUT=$3; shift 3
PY=/work/main/.venv/bin/python
MODEL=/work/main/results/ckpt-qwen3-4l256
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
PP=$TREE
[ "${TRACE:-0}" = 1 ] && PP=/tmp/hb/site:$TREE
PORT=$($PY -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
cd "$TREE"
PYTHONPATH=$PP setsid $PY -m pdserve up --kv-transfer "$MODE" --transport tcp --model "$MODEL" \
  --port "$PORT" --local-prefill-below 0 --log-dir "$OUT/logs" \
  -- --dtype float32 --kv-cache-memory 1 >"$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 1 240); do
  grep -q "ready" "$OUT/up.log" && break
  kill -0 $UP 2>/dev/null || { echo "up died"; cat "$OUT/up.log"; exit 1; }
  sleep 0.5
done
for w in "$@"; do
  case $w in
    serial) ARGS="--max-concurrency 1 --request-rate inf --num-prompts ${NSER:-40}" ;;
    rate2) ARGS="--request-rate 2 --num-prompts ${NRATE:-48}" ;;
  esac
  echo "== $MODE $w $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$PP timeout 300 $PY -m pdserve bench serve --base-url "http://127.0.0.1:$PORT" \
    --input-len 1024 --output-len ${OLEN:-64} --seed 0 --num-warmups 3 --disable-tqdm --cpus 0 \
    $ARGS --save-result "$OUT/$w.json" 2>&1 | grep -iE "handoff|TTFT|TPOT|Successful|failed" | grep -iE "median|p99|Succ|fail"
done
kill -TERM $UP; wait $UP 2>/dev/null
