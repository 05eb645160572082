#!/bin/bash
# A/B, alternating before/after per scenario, 3 rounds; report each; one core (core 0).
HERE=$(cd "$(dirname "$0")" && pwd)
PY=$(cd "$HERE/../../.." && pwd)/.venv/bin/python
# PF holds the two code trees (PF/before/pdserve, PF/after/pdserve) and the writer runs' output.
PF=${PF:-/tmp/pf}
echo "start $(date -u +%T) load $(cat /proc/loadavg)"
for sc in "p4k builtin:small 2048" "p4k builtin:small 4096" "p1k builtin:small 2048" "dec builtin:small 2048" "dec1 builtin:small 2048"; do
 for rep in 1 2 3; do
  for code in before after; do
    echo -n "$code [$sc] "; (cd $PF/$code && PYTHONPATH=. taskset -c 0 $PY $HERE/prof.py $sc 2>&1 | tail -1)
  done
 done
 echo "load $(cat /proc/loadavg)"
done
for code in before after; do echo "writer $code"; $HERE/writer_cpu.sh $PF/$code $PF/wcpu2-$code 8 1817${#code} 2>&1 | grep -i "total\|writer\|watch\|engine"; done
echo "end $(date -u +%T) load $(cat /proc/loadavg)"
