#!/bin/bash
# CPU seconds of P's push writer (+watcher) thread and of P as a whole over N 4096-token
# push requests at 1 req/s; code = $1 (a directory holding pdserve/)
CODE=$1; OUT=$2; N=${3:-12}; PORT=${4:-18150}
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
PY=$REPO/.venv/bin/python
cd $CODE; mkdir -p $OUT
$PY -m pdserve up --kv-transfer push --model builtin:small --port $PORT --log-dir $OUT/logs > $OUT/up.txt 2>&1 &
UP=$!
for i in $(seq 120); do grep -q ready $OUT/up.txt && break; sleep 1; done
P=$(grep -E "^\s+prefill" $OUT/up.txt | grep -o "pid [0-9]*" | cut -d' ' -f2)
tids() { $REPO/.venv/bin/py-spy dump --pid $P 2>/dev/null | grep -E "^Thread" ; }
cpu() { awk '{print $14+$15}' /proc/$P/task/$1/stat; }
$PY -m pdserve bench serve --base-url http://127.0.0.1:$PORT --input-len 4096 --output-len 16 --num-prompts 2 --request-rate inf --max-concurrency 1 --ignore-eos --disable-tqdm > /dev/null 2>&1
tids > $OUT/threads.txt
declare -A T0
for t in $(ls /proc/$P/task); do T0[$t]=$(cpu $t); done
P0=$(awk '{print $14+$15}' /proc/$P/stat)
$PY -m pdserve bench serve --base-url http://127.0.0.1:$PORT --input-len 4096 --output-len 16 --num-prompts $N --request-rate 1 --seed 1 --ignore-eos --disable-tqdm > $OUT/serve.txt 2>&1
echo "P total ticks: $(( $(awk '{print $14+$15}' /proc/$P/stat) - P0 ))" | tee $OUT/cpu.txt
for t in $(ls /proc/$P/task); do
  name=$(grep -o "Thread $t ([^)]*) *\"[^\"]*\"\|Thread 0x[0-9A-F]* (\w*) \"[^\"]*\"" $OUT/threads.txt | head -1)
  n=$(grep -E "Thread (0x[0-9A-Fa-f]+ )?\(?.*$t" $OUT/threads.txt | head -1)
  d=$(( $(cpu $t) - ${T0[$t]:-0} ))
  [ $d -gt 0 ] && echo "tid $t ticks $d  $n" | tee -a $OUT/cpu.txt
done
kill -TERM $UP; wait $UP
