"""P and D on separate "hosts": two network namespaces joined by a veth pair.

Every other P/D test runs on loopback, where the tcp backend takes its Unix-socket fast path
and UCX copies with CMA. Here P lives in one namespace (10.231.7.1/24) and D in another
(10.231.7.2/24); the only link between them is the veth pair, so KV has to cross a real
network interface, as between two machines. The router and the test's client sit in P's
namespace (the client from a thread that entered it), so no traffic leaves the namespaces
the test made. The monolithic reference runs on loopback in the test's own namespace.

Asserted for tcp and nixl (UCX over TCP), pull and push:
- greedy token ids through P/D equal the monolithic instance's;
- the instances advertise their veth addresses (`/kv/info`), and D's veth received at least
  as many bytes as the KV the instances report moved: the KV crossed the veth. (With UCX's
  default transports this fails: processes of one kernel copy with CMA even across network
  namespaces, so the test sets `UCX_TLS=tcp`, as docs/transport.md explains.)

The namespaces and the veth get unique names and are deleted by a finalizer, also when a
test fails. Skipped, with the reason, where `ip netns add` is not permitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import httpx
import procs
import pytest
from procs import PdserveProcess
from test_pd_e2e import nixl_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
P_ADDR, D_ADDR, PREFIX_LEN = "10.231.7.1", "10.231.7.2", 24
P_PORT, D_PORT, ROUTER_PORT = 8100, 8200, 8000  # the namespaces are new: every port is free
MODEL = "builtin:tiny"
MAX_TOKENS = 12
PROMPT_LENGTHS = (1, 17, 300, 1000, 64, 513)  # 1 to 63 KV blocks of 16 tokens
# UCX picks CMA/shared memory between processes of one kernel, whatever their network
# namespace; only its tcp transport goes through the veth.
NIXL_ENV = {"UCX_TLS": "tcp"}


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _ip_ok(*args: str) -> None:
    r = _ip(*args)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass(frozen=True)
class VethPair:
    """Two network namespaces, each holding one end of a veth pair, with addresses and lo up.

    The test owns both namespaces; deleting a namespace deletes the veth end inside it (and
    with it the pair)."""

    ns_p: str
    ns_d: str
    dev_p: str
    dev_d: str

    @classmethod
    def create(cls) -> VethPair:
        tag = secrets.token_hex(3)  # interface names: at most 15 characters
        pair = cls(f"pdserve-{tag}-p", f"pdserve-{tag}-d", f"pdv{tag}p", f"pdv{tag}d")
        r = _ip("netns", "add", pair.ns_p)
        if r.returncode != 0:
            pair.delete()  # in case it left something behind
            pytest.skip(f"`ip netns add` is not permitted here: {r.stderr.strip()}")
        try:
            _ip_ok("netns", "add", pair.ns_d)
            _ip_ok("link", "add", pair.dev_p, "type", "veth", "peer", "name", pair.dev_d)
            for ns, dev, addr in ((pair.ns_p, pair.dev_p, P_ADDR), (pair.ns_d, pair.dev_d, D_ADDR)):
                _ip_ok("link", "set", dev, "netns", ns)
                _ip_ok("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
                _ip_ok("-n", ns, "link", "set", "lo", "up")
                _ip_ok("-n", ns, "link", "set", dev, "up")
        except BaseException:
            pair.delete()
            raise
        return pair

    def delete(self) -> None:
        for ns in (self.ns_p, self.ns_d):
            _ip("netns", "delete", ns)  # may not exist if creation failed half-way
        _ip("link", "delete", self.dev_p)  # only if it never left the root namespace

    def rx_bytes(self, ns: str, dev: str) -> int:
        """Bytes received so far by `dev` in namespace `ns` (the kernel's counter)."""
        r = _ip("-n", ns, "-s", "-j", "link", "show", "dev", dev)
        return int(json.loads(r.stdout)[0]["stats64"]["rx"]["bytes"])


def _enter_netns(ns: str) -> None:
    """Move the calling thread (only it: network namespaces are per thread) into `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class InNetns:
    """A worker thread living in a network namespace: sockets it opens belong there."""

    def __init__(self, ns: str) -> None:
        self._pool = ThreadPoolExecutor(1, initializer=_enter_netns, initargs=(ns,))

    def __call__(self, fn: Callable[..., T], *args: object) -> T:
        return self._pool.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def veth() -> Iterator[VethPair]:
    if sys.platform != "linux":
        pytest.skip("network namespaces are Linux-only")
    try:
        pair = VethPair.create()
    except FileNotFoundError:
        pytest.skip("iproute2 (`ip`) is not installed")
    try:
        yield pair
    finally:
        pair.delete()


def prompts() -> list[list[int]]:
    return [[3 + (i * 7 + n) % 240 for i in range(n)] for n in PROMPT_LENGTHS]


async def complete_all(url: str) -> list[list[int]]:
    """Greedy token ids of every prompt, three requests at a time."""
    return await procs.complete_all(url, prompts(), MAX_TOKENS, concurrency=3, timeout=120)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    with PdserveProcess(["serve", "--model", MODEL]) as mono:
        out = asyncio.run(complete_all(mono.url))
    assert all(len(o) == MAX_TOKENS for o in out)
    return out


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=10, trust_env=False)


def _kv_bytes(metrics: str, mode: str) -> float:
    prefix = f'pdserve_kv_bytes_transferred_total{{mode="{mode}"}} '
    lines = metrics.splitlines()
    return next(float(line[len(prefix) :]) for line in lines if line.startswith(prefix))


def _check_in_netns(proc: PdserveProcess, ns: str) -> None:
    """The PID is pdserve itself (`ip netns exec` exec'd it) and lives in namespace `ns`, so
    stopping it by PID stops the real server."""
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        cmdline = f.read().split(b"\0")
    assert cmdline[0].decode() == sys.executable and b"pdserve" in cmdline, cmdline
    assert os.stat(f"/proc/{proc.pid}/ns/net").st_ino == os.stat(f"/run/netns/{ns}").st_ino


@dataclass
class NetnsCluster:
    prefill: PdserveProcess
    decode: PdserveProcess
    router: PdserveProcess
    in_p: InNetns  # runs calls inside P's namespace (router and client live there too)


@contextlib.contextmanager
def netns_cluster(veth: VethPair, mode: str, transport: str) -> Iterator[NetnsCluster]:
    env = NIXL_ENV if transport == "nixl" else {}

    def instance(role: str, ns: str, addr: str, port: int) -> PdserveProcess:
        args = ["serve", "--model", MODEL, "--role", role, "--kv-transfer", mode]
        args += ["--transport", transport, "--kv-host", addr, "--threads", "1"]
        return PdserveProcess(
            args, port=port, host=addr, prefix=("ip", "netns", "exec", ns), env=env
        )

    p = instance("prefill", veth.ns_p, P_ADDR, P_PORT)
    d = instance("decode", veth.ns_d, D_ADDR, D_PORT)
    router_args = ["router", "--prefill", p.url, "--decode", d.url, "--kv-transfer", mode]
    router_args += ["--local-prefill-below", "0"]  # short test prompts must cross the veth
    r = PdserveProcess(
        router_args, port=ROUTER_PORT, host=P_ADDR, prefix=("ip", "netns", "exec", veth.ns_p)
    )
    in_p, in_d = InNetns(veth.ns_p), InNetns(veth.ns_d)
    with contextlib.ExitStack() as stack:
        stack.callback(in_p.close)
        stack.callback(in_d.close)
        for proc in (p, d, r):
            stack.push(proc)  # its __exit__: stop by PID, print the log if the test failed
        for proc in (p, d, r):
            stack.callback(proc.terminate)  # runs first: the three stop in parallel
        # P and D load the model in parallel; each health check runs in a thread of the
        # namespace where its address lives. Both starts end before anything is unwound.
        starts = [in_p.submit(p.start), in_d.submit(d.start)]
        wait(starts)
        for f in starts:
            f.result()
        in_p(r.start)
        for proc, ns in ((p, veth.ns_p), (d, veth.ns_d), (r, veth.ns_p)):
            _check_in_netns(proc, ns)
        yield NetnsCluster(p, d, r, in_p)


TRANSPORTS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_across_namespaces_equals_monolithic(veth, expected, mode, transport) -> None:
    with netns_cluster(veth, mode, transport) as c:
        info_p = c.in_p(_get, f"{c.prefill.url}/kv/info").json()
        info_d = c.in_p(_get, f"{c.decode.url}/kv/info").json()
        assert (info_p["side_channel_host"], info_d["side_channel_host"]) == (P_ADDR, D_ADDR)
        assert info_p["transport"] == info_d["transport"] == transport

        rx_before = veth.rx_bytes(veth.ns_d, veth.dev_d)
        got = c.in_p(asyncio.run, complete_all(c.router.url))
        rx = veth.rx_bytes(veth.ns_d, veth.dev_d) - rx_before

        metrics = [c.in_p(_get, f"{u}/metrics").text for u in (c.prefill.url, c.decode.url)]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens) differs in {mode}/{transport}"
    kv = sum(_kv_bytes(m, mode) for m in metrics)  # pull: counted by D; push: by P
    assert kv >= sum(PROMPT_LENGTHS) * 64  # a floor far below tiny's KV per token
    assert rx >= kv, f"D's veth received {rx} B but {kv:.0f} B of KV moved: not via the veth"


def _host_identity_in(ns: str | None) -> str:
    code = "from pdserve.transfer.transport.handshake import host_identity; print(host_identity())"
    prefix = ["ip", "netns", "exec", ns] if ns else []
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_tcp_unix_fast_path_is_not_chosen_across_namespaces(veth) -> None:
    """The tcp backend dials a peer's Unix socket only when the cards' `host_id`s match;
    processes in different network namespaces (who cannot reach each other's abstract
    socket) must get different ids, processes in the same one the same."""
    ids = [_host_identity_in(ns) for ns in (veth.ns_p, veth.ns_d, None, veth.ns_p)]
    assert "None" not in ids
    assert len({ids[0], ids[1], ids[2]}) == 3
    assert ids[0] == ids[3]
