"""Client CPU per request and per streamed chunk: httpx vs aiohttp vs a bare asyncio socket.

A uvicorn server (a subprocess pinned to `--server-core`) answers `POST /post` with a
small JSON body and `POST /stream` with 64 SSE events `--gap-ms` apart; this process,
pinned to `--client-core`, sends `--requests` of each with a ~6 KB body (1,024 token ids,
as `bench` sends) and reads its own thread CPU time around them. Each client runs twice,
in the order httpx, aiohttp, raw, httpx, aiohttp, raw.

usage: http_client_cpu.py [--requests 30] [--gap-ms 2] [--client-core 0] [--server-core 1]
       (run under flock /work/notes/bench.lock)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, REPO_ROOT)
from pdserve.ports import free_port  # noqa: E402

BODY = json.dumps({"model": "m", "prompt": list(range(1024)), "max_tokens": 64}).encode()
EVENT = (
    b'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"ab","logprobs":null,"finish_reason":null}]}\n\n'
)


def server_app(gap_s: float) -> Callable:
    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        stream = scope["path"] == "/stream"
        kind = b"text/event-stream" if stream else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        )
        if not stream:
            await send({"type": "http.response.body", "body": b'{"choices":[{"text":"x"}]}'})
            return
        for _ in range(64):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            await asyncio.sleep(gap_s)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


async def measure(name: str, n: int, one: Callable[[], Awaitable[int]]) -> None:
    for _ in range(3):
        await one()
    cpu0, chunks = time.thread_time(), 0
    for _ in range(n):
        chunks += await one()
    cpu = time.thread_time() - cpu0
    per_chunk = f"{cpu / chunks * 1000:.3f}" if chunks > n else "-"
    print(f"| {name} | {cpu / n * 1000:.2f} | {chunks / n:.1f} | {per_chunk} |", flush=True)


async def clients(url: str, n: int) -> None:
    async def hx_post() -> int:
        await hx.post(f"{url}/post", content=BODY)
        return 1

    async def hx_stream() -> int:
        async with hx.stream("POST", f"{url}/stream", content=BODY) as r:
            return sum([1 async for _ in r.aiter_raw()])

    async def ah_post() -> int:
        async with ah.post(f"{url}/post", data=BODY) as r:
            await r.read()
        return 1

    async def ah_stream() -> int:
        async with ah.post(f"{url}/stream", data=BODY) as r:
            return sum([1 async for _ in r.content.iter_any()])

    async def raw_stream() -> int:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: {len(BODY)}\r\n"
        writer.write(head.encode() + b"connection: close\r\n\r\n" + BODY)
        count = 0
        while await reader.read(65536):
            count += 1
        writer.close()
        return count

    print("| client | CPU per request (ms) | chunks per request | CPU per chunk (ms) |")
    print("|---|---|---|---|")
    for _ in range(2):
        async with httpx.AsyncClient(timeout=30) as hx:
            await measure("httpx POST", n, hx_post)
            await measure("httpx stream", n, hx_stream)
        async with aiohttp.ClientSession() as ah:
            await measure("aiohttp POST", n, ah_post)
            await measure("aiohttp stream", n, ah_stream)
        await measure("asyncio socket stream", n, raw_stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server subprocess
    a = ap.parse_args()
    if a.serve is not None:
        import uvicorn

        uvicorn.run(
            server_app(a.gap_ms / 1000), host="127.0.0.1", port=a.serve, log_level="warning"
        )
        return
    port = free_port()
    argv = [sys.executable, __file__, "--serve", str(port), "--gap-ms", str(a.gap_ms)]
    server = subprocess.Popen(argv)
    os.sched_setaffinity(server.pid, {a.server_core})
    os.sched_setaffinity(0, {a.client_core})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.post(f"{url}/post", content=b"", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(clients(url, a.requests))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
