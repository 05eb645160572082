"""`disconnect` stops every process of a local Ray cluster, also one stuck past Ray's own
shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_harness import ray_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not ray_available(), reason="ray is not installed"),
]

# Runs in its own process (a local Ray cluster per process). Ray stops its own processes
# well when it can (its workers carry a parent-death signal; a worker that exits kills its
# children), so a leftover cannot be provoked from Ray deterministically: a stuck process
# that runs Ray's code below the cluster stands in for one (a worker in uninterruptible
# I/O, one whose kill was lost). It ignores SIGTERM, as a stuck worker would.
DRIVER = """
import logging, os, subprocess, sys
from pdserve.cluster.ray_local import RayConnection, connect, disconnect

logging.basicConfig(level=logging.INFO)
session = connect(RayConnection(num_cpus=1, temp_dir=sys.argv[1]))
import ray

stuck = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
ray_code = os.path.join(os.path.dirname(ray.__file__), "stuck_worker")
proc = subprocess.Popen([sys.executable, "-c", stuck, ray_code])
print(proc.pid, flush=True)
disconnect(session, grace_s=3.0)
print("disconnected", flush=True)
"""


def test_disconnect_kills_what_a_local_cluster_left_behind() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    # Not tmp_path: Ray's socket paths below it would pass the 107 bytes of AF_UNIX.
    with tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as temp:
        cmd = [sys.executable, "-c", DRIVER, temp]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    lines = run.stdout.split()
    assert run.returncode == 0 and lines[-1] == "disconnected", run.stdout + run.stderr[-3000:]
    pid = int(lines[0])
    deadline = time.monotonic() + 10  # the kill is sent; reaping an orphan is init's
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"process {pid} outlived the cluster"
    assert f"process {pid} (python) outlived the cluster: killing it" in run.stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
