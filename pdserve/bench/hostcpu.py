"""How busy the host's CPUs were during a run, and how much time the hypervisor stole.

A cloud VM's vCPUs share physical cores with other tenants: when the host is oversubscribed,
the hypervisor runs someone else on "our" core and every latency stretches, whatever the
server does. Linux counts that as `steal` in /proc/stat. `bench serve` reads the counters
before and after the measured requests and saves the shares in the result
(`host_cpu_busy`, `host_cpu_steal`), so a noisy run can be told from a slow server; the
sweep's table shows the steal of each point. Off Linux (no /proc/stat) both are None.

Ownership: nothing is kept; each call reads the file once.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

PROC_STAT = Path("/proc/stat")


class CpuTimes(msgspec.Struct, frozen=True):
    """All CPUs' cumulative times in clock ticks, from /proc/stat's `cpu` line."""

    total: int
    idle: int  # idle + iowait
    steal: int


def parse_cpu_times(text: str) -> CpuTimes | None:
    """The aggregate `cpu` line of a /proc/stat text, or None if it has none."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            # user nice system idle iowait irq softirq steal [guest guest_nice]: guests are
            # already counted in user and nice
            ticks = [int(v) for v in fields[1:9]] + [0] * max(0, 9 - len(fields))
            return CpuTimes(total=sum(ticks[:8]), idle=ticks[3] + ticks[4], steal=ticks[7])
    return None


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """Now's counters, or None where there is no /proc/stat."""
    try:
        return parse_cpu_times(path.read_text())
    except OSError:
        return None


def shares(before: CpuTimes | None, after: CpuTimes | None) -> tuple[float | None, float | None]:
    """(busy, steal) as shares of all CPU time between two readings; None when unknown.
    Busy is everything but idle and steal: this machine's own work, the benchmark's included."""
    if before is None or after is None or after.total <= before.total:
        return None, None
    total = after.total - before.total
    steal = (after.steal - before.steal) / total
    busy = 1.0 - (after.idle - before.idle) / total - steal
    return round(busy, 4), round(steal, 4)
