#!/usr/bin/env bash
# Make /tmp/hb/ab/{before,after} from the current tree: "after" is a copy of pdserve/,
# "before" the same copy with the files of the handoff change as at HEAD (git show, no writes).
set -eu
cd /work/main
rm -rf /tmp/hb/ab && mkdir -p /tmp/hb/ab/before /tmp/hb/ab/after
cp -r pdserve /tmp/hb/ab/after/ && cp -r pdserve /tmp/hb/ab/before/
for f in pdserve/transfer/push.py pdserve/transfer/pull.py pdserve/transfer/transport/tcp_link.py \
         pdserve/engine/engine.py pdserve/engine/async_engine.py pdserve/server/app.py \
         pdserve/router/dispatch.py; do
  git show "HEAD:$f" > "/tmp/hb/ab/before/$f"
done
rm -f /tmp/hb/ab/before/pdserve/transfer/hoptrace.py
find /tmp/hb/ab -name __pycache__ -prune -exec rm -rf {} +
