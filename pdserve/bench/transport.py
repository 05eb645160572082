"""`pdserve bench transport`: bandwidth and latency of a KV transport between two processes.

This process is the initiator; a spawned child is the target. For every (size, descriptors)
point the same bytes move three ways in the same run:
  - through the transport under test (WRITE or READ with a notification, posted, waited),
  - as one plain in-process memcpy (numpy copy) of the same number of bytes,
  - with --transport nixl, through NIXL's own API directly ("raw"): prepped lists made
    once, one request per transfer, same descriptors, same notification, busy polling.
Descriptors are `size / n` bytes each; the target blocks are a shuffled permutation with no
two neighbours in order, so nothing coalesces and exactly n descriptors move.

Goals printed at the end: tcp >= 1 GB/s at 64 MB; nixl >= 80% of raw NIXL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Literal

import msgspec
import numpy as np
from tqdm import tqdm

from pdserve.config import TransportConfig
from pdserve.options import add_options, option
from pdserve.transfer.transport import TransferState, Transport, create_transport
from pdserve.transfer.transport.base import BackendUnavailableError
from pdserve.transfer.transport.tcp import TcpOptions, TcpTransport

MB = 1 << 20
TCP_GOAL_GBPS = 1.0
NIXL_GOAL_RATIO = 0.8
IDLE_S = 2.0


@dataclass(frozen=True)
class TransportBenchConfig:
    """What `pdserve bench transport` measures and how it prints it (its flags)."""

    transport: Literal["tcp", "nixl"] = option("tcp", help="")
    op: Literal["write", "read"] = option("write", help="")
    sizes_mb: str = option("1,4,16,64,256", help="comma-separated sizes in MiB")
    descs: str = option("16,256,4096", help="comma-separated descriptor counts")
    iters: int = option(0, help="timed transfers per point (0: auto)")
    raw: bool = option(True, flag="--no-raw", help="skip the raw NIXL baseline")
    force_tcp: bool = option(
        False,
        help="tcp backend: use TCP even between processes of one host (default: Unix socket)",
    )
    timeout_s: float = option(30.0, flag="--timeout", help="transport timeout_s")
    seed: int = option(0, help="")
    json: bool = option(False, help="print the results as JSON only")

    def sizes(self) -> list[int]:
        """`--sizes-mb` in bytes."""
        return [int(float(s) * MB) for s in self.sizes_mb.split(",")]

    def desc_counts(self) -> list[int]:
        """`--descs` as numbers."""
        return [int(n) for n in self.descs.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench transport` (declared on `TransportBenchConfig`)."""
    add_options(parser, TransportBenchConfig)


# -- messages between the two processes ---------------------------------------------------
class TargetPlan(msgspec.Struct, frozen=True):
    kind: str
    force_tcp: bool
    timeout_s: float
    buffer_bytes: int
    regions: list[tuple[int, int]]  # (size, granule), registered in this order
    raw: bool


class TargetReady(msgspec.Struct, frozen=True):
    metadata: bytes
    raw_md: bytes
    base: int


class Command(msgspec.Struct, frozen=True):
    name: str  # "idle" (report CPU over IDLE_S) | "stop"


class CpuReport(msgspec.Struct, frozen=True):
    cpu_s: float


# -- target process -----------------------------------------------------------------------
def _open(kind: str, timeout_s: float, force_tcp: bool, engine_id: str) -> Transport:
    config = TransportConfig(kind=kind, timeout_s=timeout_s)
    if kind == "tcp" and force_tcp:
        return TcpTransport(config, engine_id, TcpOptions(same_host_unix=False))
    return create_transport(config, engine_id)


def _raw_agent(name: str):
    from pdserve.transfer.transport.nixl_peer import load_nixl

    api = load_nixl()
    conf = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return api.nixl_agent(name, conf)


def _target_main(conn: Connection, plan_bytes: bytes) -> None:
    plan = msgspec.msgpack.decode(plan_bytes, type=TargetPlan)
    t = _open(plan.kind, plan.timeout_s, plan.force_tcp, "bench-target")
    buf = np.ones(plan.buffer_bytes, dtype=np.uint8)  # touched: no page faults in the timing
    for size, granule in plan.regions:
        t.register(f"r{size}-{granule}", buf[:size], granule=granule)
    raw = _raw_agent("bench-raw-target") if plan.raw else None
    raw_md = b""
    if raw is not None:
        raw.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        raw_md = raw.get_agent_metadata()
    conn.send_bytes(
        msgspec.msgpack.encode(TargetReady(t.local_metadata(), raw_md, buf.ctypes.data))
    )
    _serve(conn, t, raw)
    t.close()


def _serve(conn: Connection, t: Transport, raw) -> None:
    """Drive progress until told to stop (tcp blocks; NIXL needs polling on the target)."""
    while True:
        if conn.poll(0):
            cmd = msgspec.msgpack.decode(conn.recv_bytes(), type=Command)
            if cmd.name == "stop":
                return
            c0 = time.process_time()
            conn.poll(IDLE_S)  # idle: only the transport's own threads run
            conn.send_bytes(msgspec.msgpack.encode(CpuReport(time.process_time() - c0)))
            continue
        if raw is None:
            t.wait_notifs(0.01)
        else:
            t.get_notifs()
            raw.get_new_notifs()


# -- measurement --------------------------------------------------------------------------
@dataclass
class Point:
    size_bytes: int
    descs: int
    iters: int
    transport_gbps: float
    transport_p50_ms: float
    transport_min_ms: float
    memcpy_gbps: float
    raw_nixl_gbps: float | None
    ratio_vs_memcpy: float
    ratio_vs_raw: float | None


def _perm(n: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation where no element is followed by its successor (nothing can merge)."""
    while True:
        p = rng.permutation(n)
        if n < 2 or not (p[1:] == p[:-1] + 1).any():
            return p


def _timed(fns: list, iters: int) -> list[list[float]]:
    """Time each function `iters` times, round-robin, so load changes hit all of them alike."""
    for fn in fns:
        fn()  # warm-up, not timed
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, times in zip(fns, out, strict=True):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return out


def _gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9


class Bench:
    """The initiator side: our transport, the raw NIXL agent, the buffers."""

    def __init__(self, cfg: TransportBenchConfig) -> None:
        self.cfg = cfg
        sizes, descs = cfg.sizes(), cfg.desc_counts()
        self.rng = np.random.default_rng(cfg.seed)
        self.grid = [(s, n) for s in sizes for n in descs if s % n == 0]
        regions = sorted(
            {
                (max(s for s, n in self.grid if s // n == g), g)
                for g in {s // n for s, n in self.grid}
            }
        )
        self.granule_region: dict[int, int] = {}
        top = max(sizes)
        self.src = self.rng.integers(0, 256, top, dtype=np.uint8)
        self.copy_dst = np.ones(top, dtype=np.uint8)
        self.want_raw = cfg.transport == "nixl" and cfg.raw
        self.t = _open(cfg.transport, cfg.timeout_s, cfg.force_tcp, "bench-initiator")
        for i, (size, granule) in enumerate(regions):
            self.granule_region[granule] = self.t.register(
                f"r{size}-{granule}", self.src[:size], granule=granule
            )
            assert self.granule_region[granule] == i  # the target registers the same list
        plan = TargetPlan(cfg.transport, cfg.force_tcp, cfg.timeout_s, top, regions, self.want_raw)
        self._start_target(plan)

    def _start_target(self, plan: TargetPlan) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_target_main, args=(child, msgspec.msgpack.encode(plan)), daemon=True
        )
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("benchmark target did not start")
        ready = msgspec.msgpack.decode(self.conn.recv_bytes(), type=TargetReady)
        self.peer = self.t.add_peer(ready.metadata)
        self.raw = None
        if self.want_raw:
            self.raw = _raw_agent("bench-raw-initiator")
            self.raw.register_memory([(self.src.ctypes.data, self.src.nbytes, 0, "")], "DRAM")
            self.raw_name = self.raw.add_remote_agent(ready.raw_md)
            self.raw_base = ready.base

    def close(self) -> None:
        try:
            self.conn.send_bytes(msgspec.msgpack.encode(Command("stop")))
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.t.close()

    def path(self) -> str:
        """How the two processes are connected (what the numbers measure)."""
        if isinstance(self.t, TcpTransport):
            return {"unix": "Unix-domain socket (same host)", "tcp": "TCP"}[
                self.t.path_to(self.peer)
            ]
        return "NIXL " + ", ".join(
            f"{k}={v}" for k, v in os.environ.items() if k.startswith("UCX_")
        )

    def iters_for(self, size: int) -> int:
        return self.cfg.iters or max(5, min(100, (1 << 30) // size))

    def measure(self, size: int, n: int) -> Point:
        d = size // n
        perm = _perm(n, self.rng)
        region = self.granule_region[d]
        loc = np.stack([np.full(n, region), np.arange(n) * d, np.full(n, d)], axis=1)
        rem = np.stack([np.full(n, region), perm * d, np.full(n, d)], axis=1)
        iters = self.iters_for(size)
        fns = [
            lambda: self._one(loc, rem),
            lambda: np.copyto(self.copy_dst[:size], self.src[:size]),
        ]
        if self.raw is not None:
            fns.append(self._raw_fn(n, d, perm))
        ours, copies, *rest = _timed(fns, iters)
        raw = rest[0] if rest else None
        p50, cp50 = statistics.median(ours), statistics.median(copies)
        raw_gbps = _gbps(size, statistics.median(raw)) if raw else None
        ours_gbps = _gbps(size, p50)
        return Point(
            size,
            n,
            iters,
            ours_gbps,
            p50 * 1e3,
            min(ours) * 1e3,
            _gbps(size, cp50),
            raw_gbps,
            ours_gbps / _gbps(size, cp50),
            ours_gbps / raw_gbps if raw_gbps else None,
        )

    def _one(self, loc: np.ndarray, rem: np.ndarray) -> None:
        post = self.t.write if self.cfg.op == "write" else self.t.read
        h = post(self.peer, loc, rem, b"bench")
        st = self.t.wait(h, self.cfg.timeout_s * 2)
        if st is not TransferState.DONE:
            raise RuntimeError(f"transfer ended in {st.value}: {self.t.error(h)}")
        self.t.release(h)

    def _raw_fn(self, n: int, d: int, perm: np.ndarray):
        """NIXL used directly: lists prepped once, one request per transfer, busy polling."""
        raw, idx = self.raw, np.arange(n, dtype=np.int32)
        lrows = np.stack(
            [self.src.ctypes.data + np.arange(n, dtype=np.uint64) * d, np.full(n, d), np.zeros(n)],
            axis=1,
        )
        rrows = np.stack(
            [self.raw_base + perm.astype(np.uint64) * d, np.full(n, d), np.zeros(n)], axis=1
        )
        lh = raw.prep_xfer_dlist("NIXL_INIT_AGENT", lrows.astype(np.uint64), "DRAM")
        rh = raw.prep_xfer_dlist(self.raw_name, rrows.astype(np.uint64), "DRAM")
        op = self.cfg.op.upper()

        def run() -> None:
            x = raw.make_prepped_xfer(op, lh, idx, rh, idx, b"bench")
            st = raw.transfer(x)
            while st == "PROC":
                st = raw.check_xfer_state(x)
            if st != "DONE":
                raise RuntimeError(f"raw NIXL transfer ended in {st}")
            x.release()

        return run

    def idle_cpu(self) -> dict[str, float]:
        """CPU seconds each process spends over IDLE_S with the transport connected and idle."""
        self.conn.send_bytes(msgspec.msgpack.encode(Command("idle")))
        c0 = time.process_time()
        time.sleep(IDLE_S)
        mine = time.process_time() - c0
        if not self.conn.poll(IDLE_S + 30):
            raise RuntimeError("benchmark target did not report its CPU time")
        theirs = msgspec.msgpack.decode(self.conn.recv_bytes(), type=CpuReport).cpu_s
        return {"initiator": mine, "target": theirs}


# -- report ---------------------------------------------------------------------------------
def _table(points: list[Point], kind: str) -> str:
    head = f"{'size':>8} {'descs':>6} {kind + ' GB/s':>11} {'p50 ms':>8}"
    head += f" {'memcpy GB/s':>12} {'x memcpy':>9}"
    if any(p.raw_nixl_gbps for p in points):
        head += f" {'raw nixl GB/s':>14} {'x raw':>7}"
    lines = [head]
    for p in points:
        line = (
            f"{p.size_bytes // MB:>5} MB {p.descs:>6} {p.transport_gbps:>11.2f} "
            f"{p.transport_p50_ms:>8.2f} {p.memcpy_gbps:>12.2f} {p.ratio_vs_memcpy:>9.2f}"
        )
        if p.raw_nixl_gbps:
            line += f" {p.raw_nixl_gbps:>14.2f} {p.ratio_vs_raw:>7.2f}"
        lines.append(line)
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _goals(points: list[Point], kind: str) -> list[str]:
    if kind == "tcp":
        at64 = [p for p in points if p.size_bytes == 64 * MB]
        return [
            f"goal tcp >= {TCP_GOAL_GBPS:g} GB/s at 64 MB, {p.descs} descs: "
            f"{p.transport_gbps:.2f} GB/s {_verdict(p.transport_gbps >= TCP_GOAL_GBPS)}"
            for p in at64
        ]
    rated = [p for p in points if p.ratio_vs_raw is not None]
    if not rated:
        return []
    worst = min(rated, key=lambda p: p.ratio_vs_raw or 0.0)
    below = [p for p in rated if (p.ratio_vs_raw or 0.0) < NIXL_GOAL_RATIO]
    return [
        f"goal nixl >= {NIXL_GOAL_RATIO:.0%} of raw NIXL: worst {worst.ratio_vs_raw:.0%} "
        f"({worst.size_bytes // MB} MB x {worst.descs}); "
        f"{len(rated) - len(below)}/{len(rated)} points met"
    ]


def run(cfg: TransportBenchConfig) -> int:
    """Measure every point of `cfg`'s grid and print the table (or JSON)."""
    # NIXL logs at INFO to stdout, which would corrupt --json; its own knob, inherited by the
    # target process. An explicit NIXL_LOG_LEVEL from the user wins.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        bench = Bench(cfg)
    except BackendUnavailableError as exc:
        print(f"pdserve bench transport: {exc}", file=sys.stderr)
        return 2
    try:
        points = [
            bench.measure(s, n)
            for s, n in tqdm(bench.grid, desc=f"{cfg.transport} {cfg.op}", file=sys.stderr)
        ]
        idle = bench.idle_cpu()
        path = bench.path()
    finally:
        bench.close()
    goals = _goals(points, cfg.transport)
    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    if cfg.json:
        out = {
            "transport": cfg.transport,
            "op": cfg.op,
            "points": [asdict(p) for p in points],
            "idle_cpu_s": idle,
            "idle_window_s": IDLE_S,
            "path": path,
            "goals": goals,
            "env": env,
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"{cfg.transport} {cfg.op} over {path}")
    print(_table(points, cfg.transport))
    cpu = f"initiator {idle['initiator']:.3f} s, target {idle['target']:.3f} s"
    print(f"idle CPU over {IDLE_S:g} s: {cpu}")
    for line in goals:
        print(line)
    return 0
