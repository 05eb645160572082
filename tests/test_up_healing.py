"""A supervised cluster heals itself: kill -9 a process under steady client load and check
what clients see, that the process comes back, and that no KV block stays held.

Real processes throughout (builtin:tiny, tcp transport, every prompt through a prefill
instance): `Cluster` + `Supervisor` as `pdserve up` runs them, and once `pdserve up` itself.
The load is a few clients in a loop, streaming and not, each pausing half a second after a
failure as a real client would; every request ends as one `Outcome`.

What each case checks:
- every request in flight at the kill ends within `HANG_S`, as a success or a clear error
  (HTTP 5xx with an OpenAI-style JSON error body, an SSE error event, or, when the router
  itself was killed, a broken connection);
- the process comes back as a new PID (an instance: a new incarnation), and requests
  succeed again within `RESUME_S` of that (1P1D), or at least 95% of the requests not in
  flight at the kill succeed (2P2D, where the other decode instance keeps serving);
- once idle, every instance's KV pool is empty (`/load`) and its connector holds no block
  (`pdserve_kv_blocks_held` in `/metrics`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Cluster, ClusterConfig
from pdserve.ports import free_port
from pdserve.supervisor import ChildBack, Supervisor
from pdserve.transfer.cluster_auth import route_headers
from tests.procs import REPO_ROOT
from tests.test_supervisor import _stop_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANG_S = 60.0  # a request still open this long after it was sent hangs
RESUME_S = 30.0  # 1P1D: requests succeed again this soon after the process is back
IDLE_S = 60.0  # the pools are empty this soon after the load ends
CLIENTS = 4  # half streaming
MAX_TOKENS = 8
# Short leases: a hold for a killed peer ends soon (the default, 30 s, would slow the test).
TOKEN = "up-healing-token"  # /kv/info and /load need a proof of it
INSTANCE_ARGS = ("--kv-lease", "5")


@dataclass(frozen=True)
class Outcome:
    sent: float  # time.monotonic()
    ended: float
    stream: bool
    result: str  # "ok", "http 502", "stream error", "transport ConnectError", "hang", "unclear"

    @property
    def ok(self) -> bool:
        return self.result == "ok"

    def in_flight_at(self, t: float) -> bool:
        return self.sent <= t < self.ended


def _body(rng: random.Random, stream: bool) -> dict:
    return {
        "prompt": [rng.randrange(10, 250) for _ in range(rng.randrange(16, 48))],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _error_body(status: int, raw: bytes) -> str:
    try:
        error = httpx.Response(status, content=raw).json().get("error")
    except ValueError:
        error = None
    ok = status >= 500 and isinstance(error, dict) and error.get("message")
    return f"http {status}" if ok else f"unclear: HTTP {status} {raw[:200]!r}"


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> str:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return _error_body(r.status_code, await r.aread())
        data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    if any('"error"' in d for d in data):
        return "stream error"
    return "ok" if data and data[-1] == "[DONE]" and len(data) > 1 else f"unclear: {data[-3:]}"


async def _plain(client: httpx.AsyncClient, url: str, body: dict) -> str:
    r = await client.post(url, json=body)
    if r.status_code != 200:
        return _error_body(r.status_code, r.content)
    text = r.json()["choices"][0].get("text")
    return "ok" if isinstance(text, str) else f"unclear: {r.text[:200]}"


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    sent = time.monotonic()
    send = _stream if body["stream"] else _plain
    try:
        result = await asyncio.wait_for(send(client, url, body), HANG_S)
    except (TimeoutError, httpx.TimeoutException):
        result = "hang"
    except httpx.HTTPError as exc:
        result = f"transport {type(exc).__name__}"
    return Outcome(sent, time.monotonic(), body["stream"], result)


class Load:
    """`CLIENTS` clients sending requests in a loop until `stop`; owns their outcomes."""

    def __init__(self, base_url: str, seed: int = 0) -> None:
        self.url = f"{base_url}/v1/completions"
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._rng = random.Random(seed)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, client: httpx.AsyncClient) -> None:
        self._tasks = [
            asyncio.create_task(self._client(client, stream=i % 2 == 0)) for i in range(CLIENTS)
        ]

    async def _client(self, client: httpx.AsyncClient, stream: bool) -> None:
        while not self._stop.is_set():
            out = await _one(client, self.url, _body(self._rng, stream))
            self.outcomes.append(out)
            if not out.ok:
                await asyncio.sleep(0.5)

    async def until(self, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), HANG_S + 10)
        return self.outcomes

    def successes_since(self, t: float) -> int:
        return sum(o.ok and o.sent >= t for o in self.outcomes)

    def resumed(self, t: float, last: int = 6) -> bool:
        """The last `last` requests sent after `t` all succeeded."""
        after = sorted((o for o in self.outcomes if o.sent >= t), key=lambda o: o.sent)
        return len(after) >= last and all(o.ok for o in after[-last:])


@dataclass(frozen=True)
class Kill:
    name: str
    at: float
    back_at: float
    old_pid: int
    new_pid: int


async def _kill_under_load(
    cluster: Cluster, sup: Supervisor, name: str, before_s: float, after_s: float
) -> tuple[list[Outcome], Kill]:
    """Load the cluster, SIGKILL `name` by PID once `before_s` of load succeeded, wait for
    the supervisor to bring it back, then load on until requests succeed again for a while
    (`after_s` at least, `RESUME_S` at most)."""
    async with httpx.AsyncClient(timeout=HANG_S, trust_env=False) as client:
        load = Load(cluster.router_url)
        load.start(client)
        started = time.monotonic()
        await load.until(lambda: load.successes_since(started) >= 4, 60)
        await asyncio.sleep(before_s)
        assert load.successes_since(started) >= 4, load.outcomes
        old_pid = cluster.process(name).pid
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        new_pid = await _back(sup, name, old_pid)
        back = time.monotonic()
        await asyncio.sleep(after_s)
        await load.until(lambda: load.resumed(back), RESUME_S)
        outcomes = await load.stop()
    return outcomes, Kill(name, killed, back, old_pid, new_pid)


async def _back(sup: Supervisor, name: str, old_pid: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = sup.running_pid(name)
        if pid is not None and pid != old_pid:
            return pid
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} is not back: {sup.events}")


def _incarnation(url: str) -> str:
    proof = route_headers(TOKEN, "/kv/info")
    return httpx.get(f"{url}/kv/info", headers=proof, timeout=5, trust_env=False).json()[
        "incarnation"
    ]


def _blocks(url: str) -> tuple[int, float]:
    """(KV blocks used, blocks the connector holds) of the instance at `url`."""
    proof = route_headers(TOKEN, "/load")
    load = httpx.get(f"{url}/load", headers=proof, timeout=5, trust_env=False).json()
    used = load["kv_blocks_used"]
    metrics = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    held = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pdserve_kv_blocks_held")
    )
    return used, held


def _assert_pools_empty(cluster: Cluster) -> None:
    deadline = time.monotonic() + IDLE_S
    while True:
        blocks = {p.name: _blocks(p.url) for p in cluster.instances}
        if all(b == (0, 0) for b in blocks.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still used/held once idle: {blocks}")
        time.sleep(0.5)


def _assert_clear_endings(outcomes: list[Outcome], kill: Kill, transport_ok: bool) -> None:
    """No hang, no unclear answer; a broken connection only where the router died."""
    bad = [o for o in outcomes if o.result == "hang" or o.result.startswith("unclear")]
    assert not bad, bad
    if not transport_ok:
        broken = [o for o in outcomes if o.result.startswith("transport")]
        assert not broken, broken
    in_flight = [o for o in outcomes if o.in_flight_at(kill.at)]
    assert in_flight, "the kill found no request in flight"
    assert all(o.ended - kill.at < HANG_S for o in in_flight), in_flight


def _resumed_at(outcomes: list[Outcome], since: float) -> float | None:
    """The earliest send time from `since` on after which every request succeeded."""
    after = sorted((o for o in outcomes if o.sent >= since), key=lambda o: o.sent)
    failures = [i for i, o in enumerate(after) if not o.ok]
    if not failures:
        return after[0].sent if after else None
    rest = after[failures[-1] + 1 :]
    return rest[0].sent if rest else None


def _config(tmp_path: Path, mode: str, prefill: int = 1, decode: int = 1) -> ClusterConfig:
    return ClusterConfig(
        kv_transfer=mode,  # type: ignore[arg-type]
        num_prefill=prefill,
        num_decode=decode,
        model="builtin:tiny",
        port=None,
        local_prefill_below=0,  # every prompt through a prefill instance and a transfer
        request_timeout_s=30.0,
        log_dir=tmp_path,
        instance_args=INSTANCE_ARGS,
        startup_timeout_s=120.0,
        cluster_token=TOKEN,  # /kv/info and /load need a proof of it
    )


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("name", ["prefill-0", "decode-0", "router"])
def test_1p1d_heals_after_a_kill(tmp_path: Path, mode: str, name: str) -> None:
    with Cluster(_config(tmp_path, mode)) as cluster, Supervisor(cluster).background(0.1) as sup:
        old_incarnation = None if name == "router" else _incarnation(cluster.process(name).url)
        outcomes, kill = asyncio.run(_kill_under_load(cluster, sup, name, 1.0, 3.0))
        _assert_clear_endings(outcomes, kill, transport_ok=name == "router")
        resumed = _resumed_at(outcomes, kill.back_at)
        late = [o for o in outcomes if o.sent >= kill.back_at and not o.ok]
        assert resumed is not None and resumed - kill.back_at <= RESUME_S, late
        assert sum(o.ok and o.sent >= resumed for o in outcomes) >= 6, outcomes
        assert kill.new_pid != kill.old_pid and cluster.process(name).pid == kill.new_pid
        if old_incarnation is not None:
            assert _incarnation(cluster.process(name).url) != old_incarnation
        assert sup.restarts()[name] == 1 and sup.given_up() == []
        assert ChildBack(name, kill.new_pid, 1) in sup.events
        _assert_pools_empty(cluster)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_2p2d_keeps_serving_while_a_decode_instance_heals(tmp_path: Path, mode: str) -> None:
    config = _config(tmp_path, mode, prefill=2, decode=2)
    with Cluster(config) as cluster, Supervisor(cluster).background(0.1) as sup:
        name = "decode-1"
        old_incarnation = _incarnation(cluster.process(name).url)
        outcomes, kill = asyncio.run(_kill_under_load(cluster, sup, name, 6.0, 6.0))
        _assert_clear_endings(outcomes, kill, transport_ok=False)
        others = [o for o in outcomes if not o.in_flight_at(kill.at)]
        succeeded = sum(o.ok for o in others)
        assert succeeded >= 0.95 * len(others), (succeeded, len(others), outcomes)
        assert _incarnation(cluster.process(name).url) != old_incarnation
        assert sup.restarts() == {
            "prefill-0": 0,
            "prefill-1": 0,
            "decode-0": 0,
            "decode-1": 1,
            "router": 0,
        }
        _assert_pools_empty(cluster)


# -- the command ----------------------------------------------------------------------------


def _read_until(proc: subprocess.Popen[str], text: str, lines: list[str], timeout: float) -> str:
    """Read `proc`'s output until a line contains `text`; that line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return line
    raise AssertionError(f"no {text!r} in the output of pdserve up:\n{''.join(lines)}")


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_command_brings_a_killed_decode_instance_back(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--kv-transfer",
        "push",
        "--model",
        "builtin:tiny",
        "--port",
        str(port),
        "--log-dir",
        str(tmp_path),
        "--",
        *INSTANCE_ARGS,
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    pids: dict[str, int] = {}
    try:
        _read_until(proc, "Ctrl-C stops everything", lines, 180)
        rows = [line.split() for line in lines if " pid " in line]
        pids = {row[0]: int(row[row.index("pid") + 1]) for row in rows}
        assert set(pids) == {"prefill", "decode", "router"}
        assert (tmp_path / "decode-0.log").read_text().startswith("$ ")
        os.kill(pids["decode"], signal.SIGKILL)
        failed = _read_until(proc, "decode-0 (pid", lines, 60)
        assert f"decode-0 (pid {pids['decode']}) exited with code -9; restarting in" in failed
        back = _read_until(proc, "decode-0 back", lines, 120)
        new_pid = int(back.split("(pid ")[1].split(",")[0])
        assert new_pid != pids["decode"] and not _pid_gone(new_pid)
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/completions"
        deadline = time.monotonic() + RESUME_S
        while (status := _post_status(url, body)) != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        _stop_up(proc)
    assert all(_pid_gone(pid) for pid in (*pids.values(), new_pid)), pids


def _post_status(url: str, body: dict) -> int:
    try:
        return httpx.post(url, json=body, timeout=30, trust_env=False).status_code
    except httpx.HTTPError:
        return 0
