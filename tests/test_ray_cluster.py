"""`pdserve up --ray` on a local Ray cluster the test starts (loopback only, dashboard off,
2 CPUs, in a temporary folder) and stops: P/D outputs equal the monolithic instance's,
every Ray process stays on loopback, Ray's restarts are re-admitted, scaling drains."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_harness import (
    PROMPTS,
    complete,
    descendants,
    non_loopback,
    process_lines,
    ray_available,
    sockets_of,
    wait_for,
)

from pdserve.faults import NO_FAULTS, Faults

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not ray_available(), reason="ray is not installed (pip install pdserve[ray])"
    ),
]

TOKEN = "ray-test-cluster-token-0123456789"
ACTOR_CPUS = 0.25


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from pdserve.cluster.ray_local import RayConnection, connect, disconnect

    temp = Path(tmp_path_factory.mktemp("ray"))
    session = connect(RayConnection(num_cpus=2, temp_dir=temp))
    try:
        yield
    finally:
        disconnect(session)


@pytest.fixture(scope="module")
def reference(ray_session: None) -> Iterator[dict[str, str]]:
    """The monolithic instance's greedy outputs of PROMPTS (an actor, like the others)."""
    import ray

    from pdserve.cluster.ray_actors import InstanceActorSpec, remote_classes

    _, instance_cls, _ = remote_classes()
    spec = InstanceActorSpec("both-0", "both", None, "tcp", None, threads=1)
    mono = instance_cls.options(num_cpus=ACTOR_CPUS).remote(spec, TOKEN, None)
    try:
        url = ray.get(mono.record.remote()).url
        yield {p: complete(url, p) for p in PROMPTS}
    finally:
        ray.kill(mono, no_restart=True)


def _cluster(
    mode: str, num_prefill: int, num_decode: int, *extra: str, faults: Faults = NO_FAULTS
):  # -> RayCluster
    from pdserve.cluster.ray_cluster import RayCluster, RayClusterConfig
    from pdserve.launcher import ClusterConfig

    config = ClusterConfig(
        kv_transfer=mode,  # type: ignore[arg-type]
        num_prefill=num_prefill,
        num_decode=num_decode,
        port=None,
        local_prefill_below=0,  # every prompt crosses from P to D
        instance_args=("--num-kv-blocks", "128", *extra),
    )
    ray_config = RayClusterConfig(config, actor_cpus=ACTOR_CPUS, drain_timeout_s=180, faults=faults)
    return RayCluster(ray_config, TOKEN)


def _blocks_used(cluster) -> dict[str, int | None]:
    loads = {r.name: cluster.load(r.name) for r in cluster.records()}
    return {name: (load.kv_blocks_used if load else None) for name, load in loads.items()}


def _no_blocks_used(cluster) -> bool:
    return all(used == 0 for used in _blocks_used(cluster).values())


@pytest.mark.parametrize(
    ("mode", "num_prefill", "num_decode"),
    [("push", 1, 1), ("pull", 1, 1), ("push", 2, 2), ("pull", 2, 2)],
)
def test_pd_on_ray_equals_monolithic_on_loopback(
    reference: dict[str, str], mode: str, num_prefill: int, num_decode: int
) -> None:
    with _cluster(mode, num_prefill, num_decode) as cluster:
        records = cluster.records()
        assert [r.role for r in records] == ["prefill"] * num_prefill + ["decode"] * num_decode
        assert all(r.url.startswith("http://127.0.0.1:") for r in records)
        # Twice round the prompts, so that with 2P2D every instance serves some.
        for prompt in PROMPTS * num_prefill:
            assert complete(cluster.router_url, prompt) == reference[prompt]
        wait_for(lambda: _no_blocks_used(cluster), 30, f"blocks freed: {_blocks_used(cluster)}")
        ray_pids = descendants(os.getpid()) - {os.getpid()}
        served = {r.pid for r in records} | {cluster.router_pid}
        assert served <= ray_pids  # the serving processes are the actors Ray started here
        listening = [s for s in sockets_of(ray_pids) if s[0] == "LISTEN"]
        assert len(listening) >= 8  # GCS, raylet, workers, instances, router
        assert non_loopback(ray_pids) == []


def test_kill_9_of_an_actor_process_is_healed_by_ray(reference: dict[str, str]) -> None:
    with _cluster("push", 1, 1) as cluster:
        before = {r.name: r for r in cluster.records()}
        os.kill(before["decode-0"].pid, signal.SIGKILL)
        wait_for(
            lambda: cluster.records()[1].pid != before["decode-0"].pid,
            300,
            "Ray to restart decode-0",
        )
        after = {r.name: r for r in cluster.records()}
        assert after["decode-0"].restarts == 1 and after["decode-0"].url != before["decode-0"].url
        assert any("decode-0 restarted by Ray" in line for line in cluster.changes())
        cluster.wait_router_sees(2)
        for prompt in PROMPTS:
            assert complete(cluster.router_url, prompt) == reference[prompt]
        wait_for(lambda: _no_blocks_used(cluster), 30, f"blocks freed: {_blocks_used(cluster)}")


def test_scale_up_and_drain_under_load_lose_no_request(reference: dict[str, str]) -> None:
    # Every engine step 30 ms longer, so that requests are still running when the drain
    # starts, however fast this machine is.
    # 512 blocks: on a loaded host D may register later than P finishes; the burst must
    # not reach P's cap on unclaimed holds (a 503 by design, not what this test is about).
    big = ("--num-kv-blocks", "512")
    with _cluster("push", 1, 1, *big, faults=Faults(step_delay_s=0.03)) as cluster:
        added = cluster.add_instance("decode")
        assert added.name == "decode-1"
        cluster.wait_router_sees(3)
        prompts = list(PROMPTS) * 3
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, cluster.router_url, p, 48) for p in prompts]
            wait_for(lambda: _busy(cluster, "decode-1"), 120, "requests on decode-1")
            cluster.remove_instance("decode-1")  # drained while requests run
            outputs = [f.result() for f in futures]
        assert all(outputs)
        assert [r.name for r in cluster.records()] == ["prefill-0", "decode-0"]
        for prompt in PROMPTS:
            assert complete(cluster.router_url, prompt, 48).startswith(reference[prompt])
        assert cluster.changes() == []  # a drained instance is not a failure


def _busy(cluster, name: str) -> bool:
    load = cluster.load(name)
    return load is not None and load.num_running > 0


def test_planner_scales_up_under_load_and_down_when_idle(reference: dict[str, str]) -> None:
    """The planner's real loop on Ray (2 cores: the mechanism, not the speed): long prompts
    queue up on P (its steps made 100 ms longer on purpose, so this does not depend on the
    machine's speed), so it adds a prefill instance; an idle window then shows prefill well
    within target, so it drains one again."""
    from pdserve.cluster.planner_loop import RayPlannerLoop
    from pdserve.planner.config import PlannerConfig
    from pdserve.planner.policy import Action

    cfg = PlannerConfig(
        ttft_target_s=5.0,  # P's queue, not a latency, is what gets over its limit here
        tpot_target_s=60.0,
        queue_high=0.5,
        max_prefill=2,
        max_decode=1,
        max_total=3,
        cooldown=0,
    )
    # 512 blocks: the burst must queue on P, not hit P's cap on unclaimed holds (a 503);
    # one sequence at a time, so it stays queued there (and on D: both hot, P can grow).
    slow = ("--num-kv-blocks", "512", "--max-num-seqs", "1")
    with _cluster("push", 1, 1, *slow, faults=Faults(step_delay_s=0.1)) as cluster:
        planner = RayPlannerLoop(cluster, cfg)
        prompts = [p * 4 for p in PROMPTS] * 4
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, cluster.router_url, p, 4) for p in prompts]
            wait_for(lambda: _waiting(cluster, "prefill-0") >= 2, 120, "a queue on prefill-0")
            # The planner's own window may see the queue already moved on to D (whose
            # growth the bounds forbid: a hold), so it steps until it sees P's queue, as its
            # loop would every interval; the burst is long enough for that.
            up = _step_until(planner, Action.ADD_PREFILL, futures)
            assert all(f.result() for f in futures)
        assert up.action is Action.ADD_PREFILL, [d.reason for d in planner.decisions]
        assert cluster.names("prefill") == ["prefill-0", "prefill-1"]
        cluster.wait_router_sees(3)
        planner.observe()  # the burst's last requests end this window
        down = planner.step()  # nothing was sent since: an idle window
        assert down.action is Action.REMOVE_PREFILL, down.reason
        assert cluster.names("prefill") == ["prefill-0"]
        for prompt in PROMPTS:
            assert complete(cluster.router_url, prompt) == reference[prompt]
        metrics = planner.metrics.registry
        for action in (Action.ADD_PREFILL, Action.REMOVE_PREFILL):
            labels = {"action": action.value}
            assert metrics.get_sample_value("pdserve_planner_decisions_total", labels) == 1


def _step_until(planner, action, futures: list) -> object:
    """Planner steps (0.2 s apart) until one decides `action` or the burst has ended; the
    last decision."""
    while True:
        decision = planner.step()
        if decision.action is action or all(f.done() for f in futures):
            return decision
        time.sleep(0.2)


def _waiting(cluster, name: str) -> int:
    load = cluster.load(name)
    return 0 if load is None else load.num_waiting


def test_up_ray_command_prints_the_table_serves_and_stops(tmp_path: Path) -> None:
    """`pdserve up --ray` itself: a local Ray cluster of its own, on loopback only, the
    table, a completion, and everything gone after Ctrl-C."""
    import subprocess
    import sys

    from pdserve.ports import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "up", "--ray", "--ray-num-cpus", "2"]
    cmd += ["--actor-cpus", str(ACTOR_CPUS), "--kv-transfer", "push", "--port", str(port)]
    log = tmp_path / "up.log"
    tree: set[int] = set()
    with log.open("wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "cluster token" in log.read_text(), 300, f"the table in {log}")
        text = log.read_text()
        rows = [line.split() for line in text.splitlines() if line.startswith("  ")]
        roles = [row[0] for row in rows if row[0] in ("router", "prefill", "decode")]
        assert roles == ["router", "prefill", "decode"], text
        assert all("node" in row and "127.0.0.1" in row for row in rows[2:4]), text
        assert complete(f"http://127.0.0.1:{port}", PROMPTS[0])
        tree = descendants(up.pid)
        assert len(tree) > 5 and non_loopback(tree) == []
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=120) == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 60
    while process_lines(tree) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not process_lines(tree), "\n".join(process_lines(tree))
