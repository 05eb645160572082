"""`make demo`: start one instance on the built-in model, stream a chat completion, stop it.

Until P/D serving lands this exercises the monolithic path end to end: a real
`pdserve serve` process, the official `openai` client, streaming, TTFT and tokens/s.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"server at {url} not healthy after {timeout:.0f} s")


def stream_chat(url: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id
    t0 = time.perf_counter()
    ttft, n = None, 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about disaggregated serving."}],
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    print("assistant: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            n = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    print(f"\n\nmodel {model}: {n} tokens, TTFT {1000 * (ttft or total):.1f} ms, ", end="")
    print(f"{n / max(total - (ttft or 0), 1e-9):.1f} tokens/s after the first")


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve", "serve", "--port", str(port)]
    print(f"starting: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd)
    try:
        wait_healthy(url, proc)
        stream_chat(url)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
