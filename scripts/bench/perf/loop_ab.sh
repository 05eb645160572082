#!/usr/bin/env bash
# One run of the event-loop A/B: push 1P1D on the random Qwen3 checkpoint, 1024 in / 64 out,
# one at a time (20 requests) then 2 req/s (40); prints one JSON line per workload with D's
# event-loop (main thread) and engine-thread CPU per output token, TPOT and handoff.
# usage: [MODEL=CKPT] scripts/bench/perf/loop_ab.sh TAG [HIDE...]
# MODEL: a checkpoint dir (default results/ckpt-qwen3-4l256, from `pdserve bench make-checkpoint`)
# HIDE: modules to hide from every process of the cluster (e.g. httptools), by a module that
# raises ImportError put first on PYTHONPATH. (The session 5 runs also hid or showed uvloop;
# since then uvicorn's loop is pinned to asyncio, UVICORN_LOOP in pdserve/httpd/bootstrap.py.)
case "${1:-}" in -h|--help) sed -n "2,9p" "$0" | cut -c3-; exit 0;; esac
set -u
cd "$(dirname "$0")/../../.."
TAG=$1; shift
OUT=results/loop-ab/$TAG; rm -rf "$OUT"; mkdir -p "$OUT/hide"
for m in "$@"; do echo 'raise ImportError("hidden for the A/B")' > "$OUT/hide/$m.py"; done
export PYTHONPATH=$PWD/$OUT/hide${PYTHONPATH:+:$PYTHONPATH}
PY=.venv/bin/python
PORT=$($PY -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
setsid $PY -m pdserve up --kv-transfer push --transport tcp --model "${MODEL:-results/ckpt-qwen3-4l256}" \
  --port "$PORT" --local-prefill-below 0 --log-dir "$OUT/logs" \
  -- --dtype float32 --kv-cache-memory 1 > "$OUT/up.log" 2>&1 &
UP=$!
for _ in $(seq 240); do grep -q ready "$OUT/up.log" && break; sleep 0.5; done
DPID=$(grep -o "started decode-0 (pid [0-9]*" "$OUT/up.log" | grep -o "[0-9]*$")
snap() { for t in /proc/$DPID/task/*; do echo "$(basename "$t") $(awk '{print $14+$15}' "$t/stat")"; done | sort; }
loaded=$(grep -o -E "uvloop|httptools" /proc/"$DPID"/maps | sort -u | tr '\n' ' ')
bench() { $PY -m pdserve bench serve --base-url "http://127.0.0.1:$PORT" --input-len 1024 \
  --output-len 64 --ignore-eos --disable-tqdm --cpus 0 "$@"; }
bench --num-prompts 3 --max-concurrency 1 --request-rate inf --seed 1 > /dev/null 2>&1
for w in serial rate2; do
  case $w in
    serial) args=(--max-concurrency 1 --request-rate inf --num-prompts 20) ;;
    rate2) args=(--request-rate 2 --num-prompts 40) ;;
  esac
  snap > "$OUT/a.txt"
  bench "${args[@]}" --seed 0 --save-result "$OUT/$w.json" > "$OUT/$w.txt" 2>&1
  snap > "$OUT/b.txt"
  # the event loop runs in the main thread (tid == pid); the engine is the busiest other one
  read -r loop eng < <(join "$OUT/a.txt" "$OUT/b.txt" \
    | awk -v p="$DPID" '{d=($3-$2)*10; if ($1==p) l=d; else if (d>e) e=d} END {print l, e}')
  $PY - "$OUT/$w.json" "$TAG" "$w" "$loaded" "$loop" "$eng" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
tag, w, loaded, loop, eng = sys.argv[2:]
toks = r["total_output_tokens"]
print(json.dumps({
    "tag": tag, "w": w, "loaded": loaded.split(),
    "loop_ms_tok": round(float(loop) / toks, 3), "eng_ms_tok": round(float(eng) / toks, 3),
    "tpot_p50": round(r["median_tpot_ms"], 2), "tpot_p99": round(r["p99_tpot_ms"], 2),
    "ttft_p50": round(r["median_ttft_ms"], 1), "handoff_p50": round(r["median_handoff_ms"], 2),
    "load": open("/proc/loadavg").read().split()[0],
}))
PYEOF
done
kill -TERM $UP; wait $UP
