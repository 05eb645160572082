#!/usr/bin/env bash
# xPyD benchmark: for each topology (P,D) and each MODE, start `pdserve up`, run
# `pdserve bench serve` at rate BASE_RATE x P, stop the cluster by PID. One cluster at a time;
# the modes alternate within a topology so that load drift hits both alike.
# usage: run_xpyd.sh OUTDIR "pull push" "1,1 2,1 1,2 2,2"
case "${1:-}" in -h|--help) sed -n "2,5p" "$0" | cut -c3-; exit 0;; esac
set -u
cd "$(dirname "$0")/../../.."  # the repo root: OUTDIR is relative to it
OUT=$1; MODES=$2; TOPOS=$3
BASE_RATE=${BASE_RATE:-1.0}; NUM=${NUM:-24}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-64}
PY=.venv/bin/python
mkdir -p "$OUT"
for topo in $TOPOS; do
  for mode in $MODES; do
    P=${topo%,*}; D=${topo#*,}
    tag="${mode}-${P}p${D}d"
    port=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
    rate=$($PY -c "print($BASE_RATE*$P)")
    echo "== $tag rate $rate port $port $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    $PY -m pdserve up --kv-transfer "$mode" --prefill "$P" --decode "$D" --no-pin \
        --model builtin:small --port "$port" --log-dir "$OUT/logs-$tag" \
        -- --threads 1 --num-kv-blocks 4096 > "$OUT/up-$tag.log" 2>&1 &
    up=$!
    for i in $(seq 300); do grep -q "ready" "$OUT/up-$tag.log" && break; kill -0 $up || break; sleep 1; done
    if ! grep -q "ready" "$OUT/up-$tag.log"; then echo "cluster failed"; tail -20 "$OUT/up-$tag.log"; kill -TERM $up; wait $up; continue; fi
    $PY -m pdserve bench serve --base-url "http://127.0.0.1:$port" --input-len "$IN" \
        --output-len "$OUTLEN" --num-prompts "$NUM" --request-rate "$rate" --seed 0 \
        --num-warmups 2 --label "$tag" --metadata mode=$mode prefill=$P decode=$D \
        load_before="$(cut -d' ' -f1 /proc/loadavg)" \
        --save-result "$OUT/$tag.json" --disable-tqdm > "$OUT/bench-$tag.log" 2>&1
    echo "   bench rc=$? load after $(cut -d' ' -f1-3 /proc/loadavg)"
    kill -TERM $up; wait $up
  done
done
