"""Fault matrix with real processes (tcp transport): kills, restarts, injected errors.

Each case: every client gets a completion or a clear error within a bound, no process
hangs, every surviving instance's KV pool returns to full, and the next requests succeed.
Processes are started one by one (tests/procs.py) so that one of them can be killed
(SIGKILL, by PID) and restarted on the same ports with a new incarnation.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from contextlib import ExitStack

import httpx
import pytest

from pdserve.faults import Faults
from tests.procs import PdserveProcess, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BOUND_S = 30.0  # every request ends within this, whatever was killed


class Trio:
    """A prefill, a decode and a router process on fixed ports, each restartable."""

    def __init__(
        self, mode: str, p_args=(), d_args=(), p_faults: Faults | None = None, d_faults=None
    ) -> None:
        self.mode = mode
        self.faults = {"prefill": p_faults, "decode": d_faults}
        self.ports = dict(zip(("p", "p_side", "d", "router"), free_ports(4), strict=True))
        self.p_args, self.d_args = tuple(p_args), tuple(d_args)
        self.procs: dict[str, PdserveProcess] = {}
        self.stack = ExitStack()

    def _instance(self, role: str) -> PdserveProcess:
        extra = self.p_args if role == "prefill" else self.d_args
        args = ["serve", "--role", role, "--kv-transfer", self.mode, "--threads", "1", *extra]
        if role == "prefill":
            args += ["--side-channel-port", str(self.ports["p_side"])]
        port = self.ports["p" if role == "prefill" else "d"]
        return PdserveProcess(args, port=port, faults=self.faults[role])

    def start(self, name: str) -> None:
        if name == "router":
            proc = PdserveProcess(
                [
                    "router",
                    "--prefill",
                    self.url("p"),
                    "--decode",
                    self.url("d"),
                    "--kv-transfer",
                    self.mode,
                    "--request-timeout",
                    "60",
                    "--local-prefill-below",  # every request goes through P (and a transfer)
                    "0",
                ],
                port=self.ports["router"],
            )
        else:
            proc = self._instance({"p": "prefill", "d": "decode"}[name])
        self.procs[name] = self.stack.enter_context(proc)

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].stop()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def __enter__(self) -> Trio:
        for name in ("p", "d", "router"):
            self.start(name)
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def blocks_used(self, name: str) -> int:
        return httpx.get(f"{self.url(name)}/load", timeout=5).json()["kv_blocks_used"]

    def wait_free(self, names=("p", "d"), timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        used = {}
        while time.monotonic() < deadline:
            used = {n: self.blocks_used(n) for n in names}
            if not any(used.values()):
                return
            time.sleep(0.25)
        raise AssertionError(f"KV blocks leaked: {used}")

    def wait_router_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url('router')}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError("router never became healthy again")

    def wait_router_knows_p(self, incarnation: str, timeout: float = 60.0) -> None:
        """Until the router has admitted P again and, in push mode (where D's params carry
        P's identity as the router last read it), has read P's new incarnation."""
        deadline = time.monotonic() + timeout
        row: dict = {}
        while time.monotonic() < deadline:
            rows = httpx.get(f"{self.url('router')}/router/instances", timeout=5).json()
            row = next(r for r in rows if r["url"] == self.url("p"))
            seen = (row["info"] or {}).get("incarnation")
            if row["admitted"] and (self.mode == "pull" or seen == incarnation):
                return
            time.sleep(0.1)
        raise AssertionError(f"the router never took up P's restart: {row}")


def body(n: int, max_tokens: int = 24, stream: bool = True, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {
        "prompt": [rng.randrange(3, 250) for _ in range(n)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def one(client: httpx.AsyncClient, url: str, b: dict) -> str:
    """'ok' for a full completion, else the error the client saw (never hangs)."""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=b) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode()
                assert '"error"' in text, text  # OpenAI-style JSON error, not a crash page
                return f"http {r.status_code}"
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"
    if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
        return "stream error"
    return "ok"


async def storm(
    url: str, n: int, kill=None, kill_after: float = 0.3, max_tokens: int = 24
) -> list[str]:
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        tasks = [
            asyncio.ensure_future(one(client, url, body(300 + 50 * i, max_tokens, seed=i)))
            for i in range(n)
        ]
        if kill:
            await asyncio.sleep(kill_after)
            kill()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S + 10))


def ok_now(url: str, n: int = 3) -> list[str]:
    return asyncio.run(storm(url, n))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kill_prefill_mid_flight_then_restart_with_new_incarnation(mode) -> None:
    # P's steps are slowed so the kill at 0.3 s always finds prefills still running: on a
    # fast machine all twelve could otherwise be prefilled (and read) before it.
    faults = Faults(step_delay_s=0.15, finish_delay_s=0.5 if mode == "push" else 0.0)
    with Trio(mode, p_faults=faults) as t:
        old = httpx.get(f"{t.url('p')}/kv/info").json()["incarnation"]
        results = asyncio.run(storm(t.url("router"), 12, kill=lambda: t.kill("p")))
        assert any(r != "ok" for r in results), results  # the kill hit requests in flight
        t.wait_free(("d",))
        t.start("p")  # same ports, new incarnation: D must not use the old metadata
        new = httpx.get(f"{t.url('p')}/kv/info").json()["incarnation"]
        assert new != old
        # A health round refreshes the router's view of P (push: the identity it gives D);
        # waited for, not slept on: a round can take seconds on a loaded machine.
        t.wait_router_knows_p(new)
        assert ok_now(t.url("router")) == ["ok"] * 3
        t.wait_free()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kill_decode_mid_flight_then_restart(mode) -> None:
    # D's steps are slowed so that no stream of 24 tokens can finish before the kill.
    with Trio(mode, p_args=("--kv-lease", "3"), d_faults=Faults(step_delay_s=0.02)) as t:
        results = asyncio.run(storm(t.url("router"), 12, kill=lambda: t.kill("d")))
        assert any(r != "ok" for r in results), results
        t.wait_free(("p",))  # holds for the dead D: write errors or lease expiry
        t.start("d")
        t.wait_router_healthy()
        assert ok_now(t.url("router")) == ["ok"] * 3
        t.wait_free()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_injected_transfer_errors_fail_only_their_requests(mode) -> None:
    # Who posts: P writes (one post per prompt without layer-wise streaming), D reads.
    faults = Faults(fail_transfer_every=3)
    if mode == "push":
        kw = {"p_args": ("--no-push-layerwise",), "p_faults": faults}
    else:
        kw = {"d_faults": faults}
    with Trio(mode, **kw) as t:
        results = ok_now(t.url("router"), 9)
        assert results.count("ok") == 6, results  # posts 3, 6, 9 failed, clearly
        t.wait_free()
        # Transient: the pair is not marked broken; the next requests (posts 10, 11) work.
        assert ok_now(t.url("router"), 2) == ["ok"] * 2
        t.wait_free()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_router_killed_mid_stream_then_restarted(mode) -> None:
    # Pull: prompts P finished for a router that died are held until their lease ends.
    # D's steps are slowed so that no reply of 400 tokens can end before the kill at 0.3 s
    # (at least 4 s of steps), however fast the machine.
    with Trio(mode, p_args=("--kv-lease", "3"), d_faults=Faults(step_delay_s=0.01)) as t:
        # Long replies, so that streams are still open when the router dies.
        kill = lambda: t.kill("router")  # noqa: E731
        results = asyncio.run(storm(t.url("router"), 8, kill=kill, max_tokens=400))
        assert any(r.startswith("transport") for r in results), results
        t.wait_free()  # the instances saw their client (the router) go away
        t.start("router")
        assert ok_now(t.url("router")) == ["ok"] * 3
        t.wait_free()


async def one_error(client: httpx.AsyncClient, url: str, b: dict) -> str | None:
    """None for a full completion, else the message of the error the client saw."""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=b) as r:
            if r.status_code != 200:
                return (await r.aread()).decode()
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}: {exc}"
    errors = [line for line in lines if '"error"' in line]
    if lines[-1] != "data: [DONE]" or errors:
        return errors[0] if errors else "stream ended without [DONE]"
    return None


async def wait_loads(t: Trio, cond, timeout: float = 60.0) -> None:
    """Poll /load of P and D until `cond(p_load, d_load)`."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            p, d = [(await client.get(f"{t.url(n)}/load")).json() for n in ("p", "d")]
            if cond(p, d):
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the cluster never reached the state to kill in")


def test_kill_decode_while_registered_in_push_mode() -> None:
    """D dies while its blocks are registered on P and P is still prefilling the prompts
    (one running, the others queued): every client gets a clear error within BOUND_S, P
    frees every prompt's blocks (the router cancels the P legs; a prompt already handed
    to P's writer fails its write or its lease ends), and a restarted D (new incarnation)
    serves the next requests."""
    # P's steps are slowed so that the state to kill in (at least two prompts still on P)
    # lasts about a second, not a few fast steps that polling could miss.
    with Trio("push", p_args=("--kv-lease", "3"), p_faults=Faults(step_delay_s=0.2)) as t:
        old = httpx.get(f"{t.url('d')}/kv/info").json()["incarnation"]

        async def scenario() -> list[str | None]:
            async with httpx.AsyncClient(timeout=BOUND_S) as client:
                long_prompts = [body(2500 + 100 * i, seed=i) for i in range(4)]
                tasks = [
                    asyncio.ensure_future(one_error(client, t.url("router"), b))
                    for b in long_prompts
                ]
                await wait_loads(
                    t,
                    lambda p, d: (
                        d["num_waiting_for_kv"] >= 2 and p["num_running"] + p["num_waiting"] >= 2
                    ),
                )
                t.kill("d")
                return list(await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S + 10))

        errors = asyncio.run(scenario())
        assert all(e is not None and "decode instance" in e for e in errors), errors
        t.wait_free(("p",))  # every prompt's blocks are back on P
        t.start("d")
        assert httpx.get(f"{t.url('d')}/kv/info").json()["incarnation"] != old
        t.wait_router_healthy()
        assert ok_now(t.url("router")) == ["ok"] * 3
        t.wait_free()
