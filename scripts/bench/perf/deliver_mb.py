"""Controlled A/B of how the engine thread hands a step's outputs to the event loop.

`per-output`: one `loop.call_soon_threadsafe` per output (pdserve before 2026-12-01);
`batched`: one per loop and step (`AsyncEngine._deliver` now). An engine thread runs a
synthetic decode step (200 small matmuls that release the GIL, ~4-7 ms here) and hands N
outputs per step to N consumer tasks, each of which formats a small JSON chunk and writes it
to a socket, as an SSE handler does. Both on one core (core 1) under one GIL, as in a D
instance. Prints the wall time per step of each variant (median over ROUNDS, alternating).

usage: flock /work/notes/bench.lock .venv/bin/python scripts/bench/perf/deliver_mb.py N STEPS ROUNDS
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time

import torch

ROWS, OPS = 1, 200


def synthetic_step(x: torch.Tensor, w: torch.Tensor) -> None:
    for _ in range(OPS):
        x = (x @ w)[:, : x.shape[1]].contiguous()


def run(n: int, steps: int, batched: bool) -> float:
    """Wall ms per step for one variant."""
    loop = asyncio.new_event_loop()
    rs, ws = socket.socketpair()
    rs.setblocking(False)
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
    x, w = torch.randn(ROWS, 256), torch.randn(256, 768)
    done = threading.Event()

    async def consumer(q: asyncio.Queue) -> None:
        while (item := await q.get()) is not None:
            ws.send(json.dumps({"id": "cmpl-x", "choices": [{"text": "ab"}], "n": item}).encode())

    async def drain() -> None:
        while not done.is_set():
            try:
                rs.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.001)

    def put_all(batch: list) -> None:
        for q, o in batch:
            q.put_nowait(o)

    def engine() -> None:
        for s in range(steps):
            synthetic_step(x, w)
            if batched:
                loop.call_soon_threadsafe(put_all, [(q, s) for q in queues])
            else:
                for q in queues:
                    loop.call_soon_threadsafe(q.put_nowait, s)
        for q in queues:
            loop.call_soon_threadsafe(q.put_nowait, None)

    async def main() -> float:
        tasks = [asyncio.ensure_future(consumer(q)) for q in queues]
        drainer = asyncio.ensure_future(drain())
        t = threading.Thread(target=engine)
        t0 = time.perf_counter()
        t.start()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        done.set()
        await drainer
        t.join()
        return wall

    try:
        return loop.run_until_complete(main()) / steps * 1e3
    finally:
        loop.close()
        rs.close()
        ws.close()


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    n, steps, rounds = map(int, sys.argv[1:4])
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    res: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for batched in (False, True) if r % 2 == 0 else (True, False):
            res[batched].append(run(n, steps, batched))
    ratios = [b / p for b, p in zip(res[True], res[False], strict=True)]
    print(
        f"N={n} per-output {statistics.median(res[False]):.3f} ms/step, "
        f"batched {statistics.median(res[True]):.3f}, batched/per-output median "
        f"{statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
