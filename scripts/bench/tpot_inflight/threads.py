"""Per-thread CPU seconds of D over its whole life, by thread name (run next to run.py).

Waits for `pdserve up`'s summary in UP_LOG, names D's threads once with `py-spy dump
--nonblocking` (does not stop D), then polls /proc every second keeping each thread's
largest utime+stime, so threads gone at shutdown still count. Writes OUT_JSON each poll.

usage: threads.py UP_LOG OUT_JSON
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procstat import thread_cpu, thread_names


def decode_pid(up_log: Path) -> int:
    while True:
        text = up_log.read_text() if up_log.exists() else ""
        if m := re.search(r"decode\s+http://\S+\s+pid (\d+)", text):
            return int(m.group(1))
        time.sleep(1)


def main() -> None:
    up_log, out = Path(sys.argv[1]), Path(sys.argv[2])
    pid = decode_pid(up_log)
    time.sleep(15)  # the transfer threads start with the first request
    label = thread_names(pid)
    best: dict[str, float] = {}
    while Path(f"/proc/{pid}").exists():
        for tid, s in thread_cpu(pid).items():
            best[tid] = max(best.get(tid, 0.0), s)
        out.write_text(json.dumps({f"{tid} {label.get(tid, '?')}": s for tid, s in best.items()}))
        time.sleep(1)


if __name__ == "__main__":
    main()
