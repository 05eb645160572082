"""The engine core process (`--engine-process`): `EngineCoreClient` is an `EngineHandle` that
gives exactly what the in-thread `AsyncEngine` gives, frees blocks on abort, fails open
streams when the core dies, and never outlives its front end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
from procs import PdserveProcess, ProcessFailed, free_port

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.engine import LLMEngine
from pdserve.engine.handle import EngineDeadError, EngineHandle
from pdserve.engine.types import EngineRequest, FinishReason, SamplingParams
from pdserve.ports import EXIT_ADDRESS_IN_USE

pytestmark = [pytest.mark.timeout(180)]

CFG = EngineConfig(
    model=ModelConfig(model="builtin:tiny"), cache=CacheConfig(num_blocks=64), threads=1
)
PROMPTS = [[3 + (i * 7 + j) % 240 for j in range(n)] for i, n in enumerate((1, 5, 40, 300))]


def request(i: int, ids: list[int], max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{i}",
        prompt_token_ids=ids,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def tokens_of(handle: EngineHandle, er: EngineRequest) -> list[int]:
    out: list[int] = []
    async with aclosing(handle.generate(er)) as stream:
        async for o in stream:
            out += o.new_token_ids
            if o.finished:
                assert o.finish_reason == FinishReason.LENGTH, o.error
    return out


async def all_tokens(handle: EngineHandle) -> list[list[int]]:
    return await asyncio.gather(*(tokens_of(handle, request(i, p)) for i, p in enumerate(PROMPTS)))


@contextlib.contextmanager
def core_client() -> Iterator[EngineCoreClient]:
    client = EngineCoreClient(CFG)
    client.start()
    try:
        yield client
    finally:
        client.shutdown()


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_core_process_output_equals_the_in_thread_engine() -> None:
    local = AsyncEngine(LLMEngine.from_config(CFG))
    local.start()
    try:
        expected = asyncio.run(all_tokens(local))
    finally:
        local.shutdown()
    with core_client() as client:
        assert client.info.model_name == "builtin:tiny" and client.info.block_size == 16
        assert asyncio.run(all_tokens(client)) == expected
        assert all(len(t) == 12 for t in expected)
        assert wait_for(lambda: client.stats().kv_blocks_used == 0)
        assert client.live_requests() == [] and client.connector_metrics() is None
        core = client.pid
    assert core is not None and not _alive(core)  # shutdown reaped it


def test_a_closed_stream_aborts_in_the_core_and_frees_its_blocks() -> None:
    async def read_some_then_leave(client: EngineCoreClient) -> int:
        er = request(9, PROMPTS[3], max_tokens=600)
        async with aclosing(client.generate(er)) as stream:
            async for o in stream:
                if o.num_output_tokens >= 3:
                    return client.stats().kv_blocks_used or _used_soon(client)
        raise AssertionError("the stream ended by itself")

    with core_client() as client:
        assert asyncio.run(read_some_then_leave(client)) > 0  # held while it ran
        assert wait_for(lambda: client.stats().kv_blocks_used == 0)
        assert wait_for(lambda: client.live_requests() == [])


def _used_soon(client: EngineCoreClient) -> int:
    wait_for(lambda: client.stats().kv_blocks_used > 0, timeout=2.0)
    return client.stats().kv_blocks_used


def test_a_dead_core_ends_open_streams_with_an_error_and_refuses_new_ones() -> None:
    async def scenario(client: EngineCoreClient) -> list[str | None]:
        er = request(1, PROMPTS[2], max_tokens=900)
        errors = []
        async with aclosing(client.generate(er)) as stream:
            async for o in stream:
                if o.num_output_tokens == 2:
                    assert client.pid is not None
                    os.kill(client.pid, signal.SIGKILL)
                if o.finished:
                    assert o.finish_reason == FinishReason.ERROR
                    errors.append(o.error)
        return errors

    with core_client() as client:
        (error,) = asyncio.run(asyncio.wait_for(scenario(client), 60))
        assert error is not None and "exited with status -9" in error
        assert not client.is_alive

        async def one_more() -> None:
            await tokens_of(client, request(2, [5]))

        with pytest.raises(EngineDeadError):
            asyncio.run(one_more())


@pytest.mark.slow  # a real instance with its core
def test_the_core_exits_when_its_front_end_is_killed() -> None:
    with PdserveProcess(["serve", "--engine-process", "--model", "builtin:tiny"]) as server:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        (core,) = _children(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        assert wait_for(lambda: not _alive(core), timeout=10), "the core outlived its front end"


def test_the_front_end_of_a_core_process_does_not_load_torch() -> None:
    """The core holds the model; its front end (HTTP, gate, metrics) must not pay torch's
    ~300 MB. Checked in the running processes' memory maps, after every route that reads
    the core's snapshot has answered."""
    args = ["serve", "--engine-process", "--role", "decode", "--kv-transfer", "push"]
    args += ["--model", "builtin:tiny", "--side-channel-port", str(free_port())]
    with PdserveProcess(args) as server:
        for route in ("/health", "/metrics", "/kv/info", "/load"):
            assert httpx.get(f"{server.url}{route}", timeout=5).status_code == 200, route
        (core,) = _children(server.pid)
        assert _maps_torch(core), "the core should hold torch (the check would be vacuous)"
        assert not _maps_torch(server.pid), "the front end loaded torch"


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow  # a real instance that fails to start
def test_a_taken_side_channel_port_fails_the_core_with_the_port_status() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        side = str(taken.getsockname()[1])
        args = ["serve", "--engine-process", "--role", "decode", "--kv-transfer", "push"]
        args += ["--model", "builtin:tiny", "--side-channel-port", side]
        proc = PdserveProcess(args, port=free_port(), startup_timeout_s=90)
        with pytest.raises(ProcessFailed, match="side channel: cannot bind"):
            proc.start()
    assert proc.returncode == EXIT_ADDRESS_IN_USE


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
