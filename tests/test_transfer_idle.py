"""An idle transfer core's threads do not wake (issue 12: no thread busy-polls).

Each thread the core starts (names `pdserve-*`: push's writer, completion watcher and D's
notification poller, the heartbeat, the side channel's receiver) is watched with a profile
hook that counts its blocking waits: `SimpleQueue.get`, `Condition.wait` (under
`Event.wait`, `Queue.get` and the transport's notification inbox), ZMQ's `Poller.poll` and
`time.sleep`. A thread that blocks until there is work waits once and is still waiting a
second later; one that wakes on a timer (every 50 ms, as push's threads once did) starts a
new wait at every tick. Both roles of both modes are checked, freshly built (idle).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from types import FrameType

import pytest
import torch
import zmq

from pdserve.config import ConnectorConfig, TransportConfig
from pdserve.kv.cache import KVCache
from pdserve.transfer import messages as m
from pdserve.transfer.connector import KVConnector
from pdserve.transfer.descriptors import OneRegion
from pdserve.transfer.kv_transport import open_kv_transport
from pdserve.transfer.pull import PullConnector
from pdserve.transfer.push import PushConnector
from tests.transfer_adapters import PdserveDouble

# Slow (it watches idle threads for seconds of real time): `make test` runs it, the unit
# tier (`make test-fast`) does not.
pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS, LAYERS, HEADS, HEAD_DIM = 4, 16, 2, 1, 8
COMPAT = m.Compat(
    model="idle",
    dtype="float32",
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    block_size=BLOCK_SIZE,
    layout="LKBTHD",
)
SETTLE_S = 0.3  # threads start and take their first wait
WATCH_S = 1.0
MAX_WAITS = 1  # per thread while watched: one wait still open may be reentered once


class _WaitCounter:
    """Counts the blocking waits begun by each thread started while installed (by name)."""

    _CODES = frozenset({threading.Condition.wait.__code__, zmq.Poller.poll.__code__})

    def __init__(self) -> None:
        self.waits: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            hit = frame.f_code in self._CODES
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            hit = (
                getattr(arg, "__name__", "") == "get" and isinstance(owner, queue.SimpleQueue)
            ) or (arg is time.sleep)
        else:
            return
        if hit:
            with self._lock:
                self.waits[threading.current_thread().name] += 1

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter({k: v for k, v in self.waits.items() if k.startswith("pdserve-")})


@pytest.fixture
def counter() -> Iterator[_WaitCounter]:
    c = _WaitCounter()
    threading.setprofile(c)
    try:
        yield c
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]  # None removes the hook


def _core(role: str, mode: str) -> KVConnector:
    kv = KVCache(torch.zeros((LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)), BLOCK_SIZE)
    ccfg = ConnectorConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}")
    regions = OneRegion.of(kv)
    transport = open_kv_transport(
        TransportConfig(kind="tcp", timeout_s=5.0), ccfg.engine_id, regions
    )
    cls = PushConnector if mode == "push" else PullConnector
    return cls(ccfg, regions, PdserveDouble(NUM_BLOCKS).side, COMPAT, transport)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_idle_core_threads_do_not_wake(mode: str, counter: _WaitCounter) -> None:
    cores = [_core("prefill", mode), _core("decode", mode)]
    try:
        time.sleep(SETTLE_S)
        for core in cores:
            core.poll()  # what an idle engine thread does: nothing to watch
        before = counter.snapshot()
        time.sleep(WATCH_S)
        after = counter.snapshot()
    finally:
        for core in cores:
            core.close()
    assert before, "no core thread was watched (the profile hook saw none)"
    woke = {name: after[name] - before[name] for name in after}
    busy = {name: n for name, n in woke.items() if n > MAX_WAITS}
    assert not busy, f"idle {mode} core threads woke (waits begun in {WATCH_S} s): {busy}"


def test_close_wakes_idle_threads_promptly() -> None:
    """Threads that block without a timeout when idle still end at once on `close`."""
    earlier = set(threading.enumerate())
    cores = [_core("prefill", "push"), _core("decode", "push")]
    time.sleep(SETTLE_S)
    mine = [t for t in threading.enumerate() if t.name.startswith("pdserve-") and t not in earlier]
    t0 = time.monotonic()
    for core in cores:
        core.close()
    took = time.monotonic() - t0
    alive = [t.name for t in mine if t.is_alive()]
    assert not alive, f"still running after close: {alive}"
    assert took < 1.5, f"close took {took:.2f} s"
