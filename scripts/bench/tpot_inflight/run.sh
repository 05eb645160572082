#!/usr/bin/env bash
# Issue 8: decode TPOT with KV transfers in flight vs none, push and pull, 1P1D builtin:small.
# Two placements in one locked run: as `pdserve up` launches it (router and bench clients
# unpinned) and isolated (router and clients moved to P's core 0, D alone on core 1).
# usage: flock /work/notes/bench.lock scripts/bench/tpot_inflight/run.sh OUTDIR
case "${1:-}" in -h|--help) sed -n "2,5p" "$0" | cut -c3-; exit 0;; esac
set -u
cd "$(dirname "$0")/../../.."
OUT=${1:-results/tpot-inflight}
PY=.venv/bin/python
ROUNDS=${ROUNDS:-2}; PLACEMENTS=${PLACEMENTS:-"as-launched isolated"}
MODES=${MODES:-"push pull"}
CONTROL=${CONTROL:+--control}  # CONTROL=1: add C windows (run.py's docstring)
echo "code $(git rev-parse --short HEAD) $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
for pl in $PLACEMENTS; do
  if [ "$pl" = isolated ]; then extra="--isolate --no-spy"; else extra=""; fi
  # shellcheck disable=SC2086
  $PY scripts/bench/tpot_inflight/run.py "$OUT/$pl" --rounds "$ROUNDS" $extra $CONTROL \
    --modes $MODES
done
echo "end $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
