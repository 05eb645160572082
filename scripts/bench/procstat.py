"""Per-process and per-thread figures from /proc and py-spy, shared by the bench drivers
(scripts/bench/tpot_inflight, scripts/bench/tpot_push_pull). Linux only."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

PYSPY = Path(__file__).resolve().parents[2] / ".venv/bin/py-spy"
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of_stat(path: Path) -> float:
    """utime + stime seconds from a /proc stat file."""
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_s(pid: int) -> float:
    """CPU seconds of the whole process."""
    return _cpu_of_stat(Path(f"/proc/{pid}/stat"))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds by thread id (threads that vanish while read are skipped)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = _cpu_of_stat(Path(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue
    return out


def run_ns(pid: int) -> dict[str, int]:
    """Thread id -> nanoseconds on a CPU so far (schedstat field 1: exact, not tick-sampled;
    threads that vanish while read are skipped)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue
    return out


def run_delay_s(pid: int) -> float:
    """Seconds the threads of `pid` sat runnable waiting for a CPU (schedstat field 2)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except OSError:
            continue
    return total / 1e9


def thread_names(pid: int) -> dict[str, str]:
    """Thread id -> Python thread name, from `py-spy dump --nonblocking` (D keeps running)."""
    dump = subprocess.run(
        [str(PYSPY), "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True
    ).stdout
    return dict(re.findall(r"^Thread (\d+) \([^)]*\): \"([^\"]+)\"", dump, re.M))
