"""The `pdserve bench serve` client's own CPU per request and per streamed token.

A fake OpenAI completions server (uvicorn, a subprocess pinned to `--server-core`) streams
each request's `max_tokens` tokens `--gap-ms` apart, one event per chunk, then usage and
[DONE]. `pdserve bench serve` runs pinned to `--client-core`, one request at a time, from
each checkout given (`--repo DIR`, repeatable: DIR's `pdserve` package with this venv's
Python, as `light_ttft.py --baseline` does), and its CPU time (user + system, from the
child's rusage) is read for three runs per checkout:
  A: 10 requests x 64 tokens, B: N x 64, C: N x 8   (N = `--requests`).
Per request of 64 tokens = (B - A) / (N - 10) (start-up cancels); per token = (B - C) /
(N x 56); fixed per request = per request - 64 x per token. Start-up (imports) varies by
~0.2 s of CPU between runs, so N must be large. Checkouts alternate, `--rounds` times.

usage: bench_client_cpu.py --repo /work/main --repo /tmp/ab-old [--rounds 2] [--requests 200]
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
from collections.abc import Callable

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, REPO_ROOT)
from pdserve.ports import free_port  # noqa: E402

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def server_app(gap_s: float) -> Callable:
    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": MODELS})
            return
        n = json.loads(body)["max_tokens"]
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for i in range(n):
            await asyncio.sleep(gap_s)
            choice = {"index": 0, "text": "ab", "finish_reason": "length" if i == n - 1 else None}
            event = _event({"id": "c", "object": "text_completion", "choices": [choice]})
            await send({"type": "http.response.body", "body": event, "more_body": True})
        usage = {"prompt_tokens": 1024, "completion_tokens": n, "total_tokens": n + 1024}
        tail = _event({"id": "c", "choices": [], "usage": usage}) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail})

    return app


def bench_cpu(repo: str, url: str, core: int, prompts: int, tokens: int) -> float:
    """CPU seconds (user + system) of one `bench serve` run from checkout `repo`."""
    argv = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url,
            "--num-prompts", str(prompts), "--input-len", "1024", "--output-len", str(tokens),
            "--max-concurrency", "1", "--num-warmups", "1", "--disable-tqdm",
            "--cpus", str(core)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=repo, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"bench serve from {repo} failed: status {status}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repo", action="append", default=[], help="a checkout (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200, help="N, above")
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server subprocess
    a = ap.parse_args()
    if a.serve is not None:
        import uvicorn

        app = server_app(a.gap_ms / 1000)
        uvicorn.run(app, host="127.0.0.1", port=a.serve, log_level="warning")
        return
    if not a.repo:
        ap.error("give at least one --repo")
    port = free_port()
    argv = [sys.executable, __file__, "--serve", str(port), "--gap-ms", str(a.gap_ms)]
    server = subprocess.Popen(argv)
    os.sched_setaffinity(server.pid, {a.server_core})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{url}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        print("| round | checkout | CPU per 64-token request (ms) | per token (ms) | fixed (ms) |")
        print("|---|---|---|---|---|")
        for rnd in range(a.rounds):
            for repo in a.repo:
                shapes = (("A", 10, 64), ("B", a.requests, 64), ("C", a.requests, 8))
                runs = {k: bench_cpu(repo, url, a.client_core, n, t) for k, n, t in shapes}
                per_request = (runs["B"] - runs["A"]) / (a.requests - 10)
                per_token = (runs["B"] - runs["C"]) / (a.requests * 56)
                fixed = per_request - 64 * per_token
                print(f"| {rnd + 1} | {repo} | {per_request * 1e3:.2f} | {per_token * 1e3:.3f} "
                      f"| {fixed * 1e3:.2f} |", flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
