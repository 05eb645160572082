"""Host CPU shares of a run (`pdserve.bench.hostcpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.hostcpu import CpuTimes, parse_cpu_times, read_cpu_times, shares

STAT = """cpu  100 5 20 800 10 1 2 62 7 0
cpu0 50 2 10 400 5 0 1 31 7 0
intr 12345
"""


def test_the_aggregate_line_is_parsed_without_double_counting_guests() -> None:
    # total = user nice system idle iowait irq softirq steal (guest is inside user)
    assert parse_cpu_times(STAT) == CpuTimes(total=1000, idle=810, steal=62)
    assert parse_cpu_times("cpu0 1 2 3\n") is None
    assert parse_cpu_times("cpu 1 2 3 4\n") == CpuTimes(total=10, idle=4, steal=0)  # old kernels


def test_shares_are_of_all_cpu_time_between_two_readings() -> None:
    before = CpuTimes(total=1000, idle=810, steal=62)
    after = CpuTimes(total=2000, idle=1310, steal=362)  # +1000: 500 idle, 300 stolen
    assert shares(before, after) == (0.2, 0.3)
    assert shares(before, before) == (None, None)
    assert shares(None, after) == (None, None)


def test_no_proc_stat_means_unknown(tmp_path: Path) -> None:
    assert read_cpu_times(tmp_path / "missing") is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_this_host_can_be_read() -> None:
    now = read_cpu_times()
    assert now is not None and 0 <= now.steal <= now.total and 0 <= now.idle <= now.total
