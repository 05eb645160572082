"""pdserve on a two-node Ray cluster whose nodes are two network namespaces joined by a veth
pair: the Ray head (and the driver, router and monolithic reference) in one, a Ray worker
in the other. P lands on the head's node and D on the worker's, each serving on its own
namespace's address, so the KV crosses the veth, over tcp and over NIXL (UCX's tcp: its
default transports would copy with CMA between processes of one kernel).

Checked: greedy outputs equal the monolithic instance's; P and D on different nodes with
different addresses; D's veth received at least the KV bytes D reports; every TCP socket of
every Ray process is on a namespace address or loopback. Skipped where `ip netns add` is not
permitted (tests/test_netns_e2e.py makes the namespaces).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_harness import host_of, ray_available, wait_for
from test_netns_e2e import D_ADDR, P_ADDR, VethPair, _kv_bytes
from test_pd_e2e import nixl_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not ray_available(), reason="ray is not installed (pip install pdserve[ray])"
    ),
]

RAY_STARTED = "Ray runtime started."  # what `ray start` prints once its node is up
GCS_PORT = 6379  # the namespaces are new: every port is free
DRIVER = Path(__file__).with_name("ray_netns_driver.py")


def _ray_env() -> dict[str, str]:
    return {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # "0" would make every node a cluster alone
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "UCX_TLS": "tcp",
        "PYTHONPATH": os.pathsep.join(
            [str(DRIVER.parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }


def _ray_start(ns: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "ray.scripts.scripts", "start"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*cmd, *args, "--num-cpus=1", "--block"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `ray start --block` ends the node's processes; then SIGKILL if needed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VethPair, dict, list]]:
    if sys.platform != "linux":
        pytest.skip("network namespaces are Linux-only")
    pair = VethPair.create()
    tmp = tmp_path_factory.mktemp("ray-netns")
    # Ray's Unix socket paths must stay under 108 bytes: short session folders.
    short = Path(tempfile.mkdtemp(prefix="pdrn-"))
    env = {**_ray_env(), "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        head_args = [
            "--head",
            f"--node-ip-address={P_ADDR}",
            f"--port={GCS_PORT}",
            f"--temp-dir={short / 'h'}",
            "--include-dashboard=false",
        ]
        nodes.append(_ray_start(pair.ns_p, head_args, env, tmp / "head.log"))
        # The worker's first contact must find the GCS up (else it exits).
        wait_for(lambda: RAY_STARTED in (tmp / "head.log").read_text(), 180, "the Ray head")
        worker_args = [
            f"--address={P_ADDR}:{GCS_PORT}",
            f"--node-ip-address={D_ADDR}",
            f"--temp-dir={short / 'w'}",  # its own: Ray's default is shared by the host
        ]
        nodes.append(_ray_start(pair.ns_d, worker_args, env, tmp / "worker.log"))
        try:
            wait_for(lambda: RAY_STARTED in (tmp / "worker.log").read_text(), 180, "the worker")
        except AssertionError:
            raise AssertionError((tmp / "worker.log").read_text()[-3000:]) from None
        yield pair, env, nodes
    finally:
        for node in reversed(nodes):
            _stop(node)
        pair.delete()
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_prefill_and_decode_on_two_nodes_kv_crosses_the_veth(
    two_nodes: tuple[VethPair, dict, list], tmp_path: Path, transport: str
) -> None:
    if transport == "nixl" and not nixl_available():
        pytest.skip("nixl is not installed")
    pair, env, nodes = two_nodes
    assert all(node.poll() is None for node in nodes), "a Ray node exited"
    rx_before = pair.rx_bytes(pair.ns_d, pair.dev_d)
    out = tmp_path / "result.json"
    cmd = ["ip", "netns", "exec", pair.ns_p, sys.executable, str(DRIVER)]
    args = [f"{P_ADDR}:{GCS_PORT}", "push", transport, P_ADDR, str(out), "serve"]
    driver = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["outputs"] == result["reference"]
    by_role = {r["role"]: r for r in result["records"]}
    assert by_role["prefill"]["node_ip"] == P_ADDR and by_role["decode"]["node_ip"] == D_ADDR
    assert by_role["prefill"]["node_id"] != by_role["decode"]["node_id"]
    assert by_role["decode"]["url"].startswith(f"http://{D_ADDR}:")
    kv = sum(_kv_bytes(m, "push") for m in result["metrics"])
    assert kv > 0 and pair.rx_bytes(pair.ns_d, pair.dev_d) - rx_before >= kv
    # A wildcard inside a namespace the test made reaches only its loopback and veth.
    bad = _foreign_sockets(pair, {P_ADDR, D_ADDR, "127.0.0.1", "::1", "0.0.0.0", "::", "*"})
    assert bad == []


def _foreign_sockets(pair: VethPair, allowed: set[str]) -> list[str]:
    """TCP sockets in the test's namespaces (every one is a Ray or pdserve process the test
    started) bound to, or talking to, any other address."""
    bad = []
    for ns in (pair.ns_p, pair.ns_d):
        cmd = ["ip", "netns", "exec", ns, "ss", "-tanH"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            state, local, peer = line.split()[0], line.split()[3], line.split()[4]
            hosts = [host_of(local)] + ([] if state == "LISTEN" else [host_of(peer)])
            if any(_plain(h) not in allowed for h in hosts):
                bad.append(f"{ns}: {state} {local} -> {peer}")
    return bad


def _plain(host: str) -> str:
    """`[::ffff:10.0.0.1]` -> `10.0.0.1`."""
    return host.strip("[]").removeprefix("::ffff:")


def test_a_node_that_leaves_takes_decode_with_it_and_ray_brings_it_back(
    two_nodes: tuple[VethPair, dict, list], tmp_path: Path
) -> None:
    """Last in the module: it stops the worker node. Decode, placed there, dies with it;
    Ray restarts it on the head (its placement was a preference), the router ejects the
    old address and admits the new one, and requests succeed again."""
    pair, env, nodes = two_nodes
    out = tmp_path / "result.json"
    cmd = ["ip", "netns", "exec", pair.ns_p, sys.executable, str(DRIVER)]
    args = [f"{P_ADDR}:{GCS_PORT}", "push", "tcp", P_ADDR, str(out), "leave"]
    driver = subprocess.Popen(
        [*cmd, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        ready = Path(f"{out}.ready")
        wait_for(lambda: ready.exists() or driver.poll() is not None, 600, "the cluster")
        assert driver.poll() is None, driver.stdout.read().decode()[-3000:] if driver.stdout else ""
        _stop(nodes[1])  # the worker node leaves
        output = driver.communicate(timeout=600)[0].decode()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 0, output[-3000:]
    after = json.loads(out.read_text())["after_leave"]
    assert (after["decode_before"], after["decode_after"]) == (D_ADDR, P_ADDR)
    assert after["restarts"] == 1 and after["equal"]
    assert any("decode-0 restarted by Ray" in line and "moved" in line for line in after["changes"])
