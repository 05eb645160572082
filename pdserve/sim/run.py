"""One simulated benchmark run: the bench workload replayed against a simulated cluster.

The workload is a `pdserve.bench.serve.BenchConfig`, and the requests and their release
times are drawn exactly as `bench serve` draws them (same functions, same random streams
from the same seed), so a simulated and a measured run with the same flags see the same
prompts lengths at the same times. The simulated client honours `max_concurrency` like the
real one (a released request waits for a slot; TTFT counts from the send). Warm-up
requests are not replayed: with `num_warmups > 0` the P-D handshakes count as done, which
is what the real warm-ups are for. The result is a `BenchResult` the bench report reads,
with `metadata` source=sim and mode=<mode>.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np

from pdserve.bench.dataset import BenchRequest
from pdserve.bench.metrics import (
    BenchResult,
    RequestRecord,
    compute_metrics,
    per_request_arrays,
)
from pdserve.bench.serve import (
    BenchConfig,
    build_requests,
    release_offsets,
    result_header,
    workload_rngs,
)
from pdserve.sim.cluster import Cluster
from pdserve.sim.cluster_config import ClusterConfig
from pdserve.sim.engine import EventLoop
from pdserve.sim.instance import SimRequest

SIM_BASE_URL = "sim://"


@dataclass(frozen=True)
class SimConfig:
    """A simulated run: the cluster, the bench workload, and a cap on simulated time."""

    cluster: ClusterConfig
    workload: BenchConfig
    time_limit_s: float = 86_400.0


def workload(wl: BenchConfig) -> tuple[list[BenchRequest], np.ndarray]:
    """The measured requests and their release offsets, as `bench serve` draws them."""
    data_rng, _warmup_rng, arrival_rng = workload_rngs(wl.seed)
    requests = build_requests(wl, data_rng)
    return requests, release_offsets(wl, requests, arrival_rng)


def prompt_length(req: BenchRequest) -> int:
    """Token count of a request; a text prompt must carry `prompt_len` in the trace."""
    if req.prompt_len is not None:
        return req.prompt_len
    if isinstance(req.prompt, list):
        return len(req.prompt)
    raise ValueError("the simulator needs token counts: give 'prompt_len' for text prompts")


class Client:
    """The benchmark client: releases requests on schedule, at most `limit` in flight."""

    def __init__(self, loop: EventLoop, cluster: Cluster, limit: int | None) -> None:
        self.loop = loop
        self.cluster = cluster
        self.limit = limit
        self.in_flight = 0
        self.queue: deque[SimRequest] = deque()

    def release(self, req: SimRequest) -> None:
        if self.limit is not None and self.in_flight >= self.limit:
            self.queue.append(req)
        else:
            self._send(req)

    def done(self, req: SimRequest) -> None:
        self.in_flight -= 1
        if self.queue:
            self._send(self.queue.popleft())

    def _send(self, req: SimRequest) -> None:
        req.send = self.loop.now
        self.in_flight += 1
        self.cluster.submit(req)


@dataclass
class SimRun:
    """What one simulation produced, before it becomes a BenchResult."""

    requests: list[SimRequest]
    duration: float
    cluster: Cluster
    bench_requests: list[BenchRequest]
    offsets: np.ndarray


def simulate(cfg: SimConfig) -> SimRun:
    """Play the workload on the cluster until every request is done (or the time cap)."""
    bench_requests, offsets = workload(cfg.workload)
    loop = EventLoop()
    client: Client
    cluster = Cluster(cfg.cluster, loop, lambda req: client.done(req))
    client = Client(loop, cluster, cfg.workload.max_concurrency)
    requests = []
    for i, (br, offset) in enumerate(zip(bench_requests, offsets.tolist(), strict=True)):
        req = SimRequest(i, prompt_length(br), br.output_len, float(offset))
        cluster.check_fits(req.prompt_len, req.output_len)
        requests.append(req)
        loop.at(req.arrival, client.release, req)
    loop.run(until=cfg.time_limit_s)
    ends = [r.token_times[-1] for r in requests if r.done]
    duration = max(ends) if ends else cfg.time_limit_s
    return SimRun(requests, duration, cluster, bench_requests, offsets)


def record_of(req: SimRequest) -> RequestRecord:
    """The client's record of one simulated request."""
    if not req.done:
        return RequestRecord(
            success=False,
            error="did not complete within the simulated time limit",
            prompt_len=req.prompt_len,
            arrival_time=req.arrival,
            start_time=req.arrival if math.isnan(req.send) else req.send,
        )
    times = req.token_times
    return RequestRecord(
        success=True,
        prompt_len=req.prompt_len,
        output_len=req.output_len,
        arrival_time=req.arrival,
        start_time=req.send,
        ttft=times[0] - req.send,
        itl=np.diff(times).tolist(),
        latency=times[-1] - req.send,
        handoff=None if req.prefill_done is None else times[0] - req.prefill_done,
    )


def sim_metadata(cfg: ClusterConfig) -> dict[str, str]:
    """The labels that mark a result as simulated and say what was simulated."""
    return {
        "source": "sim",
        "mode": cfg.mode,
        "model": cfg.model.name,
        "hardware": cfg.hardware.name,
        "software": cfg.software.name,
        "num_prefill": str(cfg.num_prefill),
        "num_decode": str(cfg.num_decode),
        "tp_prefill": str(cfg.tp_prefill),
        "tp_decode": str(cfg.tp_decode),
    }


def to_result(cfg: SimConfig, run: SimRun) -> BenchResult:
    """A `BenchResult` in the same shape `bench serve` saves (same header function)."""
    wl = cfg.workload
    records = [record_of(r) for r in run.requests]
    header = result_header(
        wl,
        run.bench_requests,
        run.offsets,
        model=cfg.cluster.model.name,
        base_url=SIM_BASE_URL,
        start_time_unix=0.0,
    )
    header["metadata"] = {**header["metadata"], **sim_metadata(cfg.cluster)}
    return BenchResult(
        **msgspec.structs.asdict(compute_metrics(records, run.duration, dict(wl.goodput))),
        **per_request_arrays(records),
        **header,
        backend="pdserve-sim",
    )


def run_sim(cfg: SimConfig) -> BenchResult:
    """Simulate one run and return its result."""
    return to_result(cfg, simulate(cfg))
