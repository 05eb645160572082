"""Aggregate py-spy raw stacks under LLMEngine.step by self and inclusive time: FILE [TOP_K]."""

from __future__ import annotations

import collections
import sys

self_c = collections.Counter()
incl = collections.Counter()
tot = 0
with open(sys.argv[1]) as fh:
    lines = fh.readlines()
for line in lines:
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    if "LLMEngine.step" not in stack:
        continue
    tot += n
    frames = stack.split(";")
    i = next(j for j, f in enumerate(frames) if "LLMEngine.step" in f)
    frames = frames[i:]
    self_c[frames[-1]] += n
    for f in set(frames):
        incl[f] += n
k = int(sys.argv[2]) if len(sys.argv) > 2 else 25
print("total", tot)
print("-- self")
for f, n in self_c.most_common(k):
    print(f"{100 * n / tot:5.1f}% {f}")
print("-- inclusive")
for f, n in incl.most_common(k):
    print(f"{100 * n / tot:5.1f}% {f}")
