#!/usr/bin/env bash
# py-spy of D (all threads, 200 Hz, 15 s) while 16 streams of 64 in / 512 out run through a
# push 1P1D builtin:small cluster; raw folded stacks to results/perf/fe-prof/spy.txt.
# usage: flock /work/notes/bench.lock bash scripts/bench/perf/frontend_spy.sh
set -u
cd "$(dirname "$0")/../../.."
OUT=results/perf/fe-prof; rm -rf $OUT; mkdir -p $OUT
PORT=$(.venv/bin/python -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
setsid .venv/bin/python -m pdserve up --kv-transfer push --model builtin:small --port $PORT --log-dir $OUT/logs -- --num-kv-blocks 4096 > $OUT/up.log 2>&1 &
UP=$!
for _ in $(seq 240); do grep -q 'Ctrl-C stops' $OUT/up.log && break; sleep 0.5; done
DPID=$(grep -oP 'decode\s+http://\S+\s+pid \K\d+' $OUT/up.log)
b() { taskset -c 0 .venv/bin/python -m pdserve bench serve --base-url http://127.0.0.1:$PORT --disable-tqdm --input-len 64 --output-len 512 --ignore-eos --max-concurrency 16 --request-rate inf "$@"; }
b --num-prompts 16 > /dev/null 2>&1
b --num-prompts 64 > $OUT/bench.txt 2>&1 &
BP=$!
sleep 3
.venv/bin/py-spy record -p $DPID -d 15 -r 200 --format raw -o $OUT/spy.txt --threads > /dev/null 2>&1
wait $BP
kill -TERM $UP; wait $UP  # TERM: a background job of a script ignores SIGINT
