"""Per-thread CPU seconds of D over its whole life, by thread name (run next to run.py).

Waits for `pdserve up`'s summary in UP_LOG, names D's threads once with `py-spy dump
--nonblocking` (does not stop D), then polls /proc every second keeping each thread's
largest utime+stime, so threads gone at shutdown still count. Writes OUT_JSON each poll.

usage: threads.py UP_LOG OUT_JSON
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PYSPY = Path(__file__).resolve().parents[3] / ".venv/bin/py-spy"


def decode_pid(up_log: Path) -> int:
    while True:
        text = up_log.read_text() if up_log.exists() else ""
        if m := re.search(r"decode\s+http://\S+\s+pid (\d+)", text):
            return int(m.group(1))
        time.sleep(1)


def names(pid: int) -> dict[str, str]:
    dump = subprocess.run(
        [str(PYSPY), "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True
    ).stdout
    return dict(re.findall(r"^Thread (\d+) \([^)]*\): \"([^\"]+)\"", dump, re.M))


def thread_cpu(pid: int) -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            f = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(f[11]) + int(f[12])) / tick
    return out


def main() -> None:
    up_log, out = Path(sys.argv[1]), Path(sys.argv[2])
    pid = decode_pid(up_log)
    time.sleep(15)  # the transfer threads start with the first request
    label = names(pid)
    best: dict[str, float] = {}
    while Path(f"/proc/{pid}").exists():
        for tid, s in thread_cpu(pid).items():
            best[tid] = max(best.get(tid, 0.0), s)
        out.write_text(json.dumps({f"{tid} {label.get(tid, '?')}": s for tid, s in best.items()}))
        time.sleep(1)


if __name__ == "__main__":
    main()
