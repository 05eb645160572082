"""Run inside a network namespace by tests/test_ray_netns.py: join the two-node Ray cluster,
start 1P1D (P on the head's node, D on the worker's), compare greedy outputs with a
monolithic actor, and write what it saw as JSON to the path given. With "leave" as the
last argument it then has the test stop the worker node and follows decode's restart."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

from pdserve.cluster.ray_actors import InstanceActorSpec, remote_classes
from pdserve.cluster.ray_cluster import RayCluster, RayClusterConfig
from pdserve.cluster.ray_local import RayConnection, connect
from pdserve.launcher import ClusterConfig
from pdserve.transfer.cluster_auth import route_headers

PROMPTS = ("The capital of France is " * 12, "Once upon a time, in a land far away, " * 9)
TOKEN = "ray-netns-cluster-token-0123456789"


def complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300, trust_env=False)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def main(
    address: str, mode: str, transport: str, router_host: str, out: str, mode_of_test: str
) -> None:
    config = ClusterConfig(
        kv_transfer=mode,  # type: ignore[arg-type]
        transport=transport,  # type: ignore[arg-type]
        host=router_host,
        port=None,
        local_prefill_below=0,
    )
    ray_config = RayClusterConfig(config, RayConnection(address=address), actor_cpus=0.25)
    connect(ray_config.connection)  # before importing ray (its authentication mode)
    import ray

    deadline = time.monotonic() + 180
    while sum(n["Alive"] for n in ray.nodes()) < 2:  # the worker may still be joining
        if time.monotonic() > deadline:
            raise SystemExit("the worker node did not join")
        time.sleep(0.5)
    with RayCluster(ray_config, TOKEN) as cluster:
        _, instance_cls, _ = remote_classes()
        spec = InstanceActorSpec("both-0", "both", None, "tcp", None, threads=1)
        mono = instance_cls.options(num_cpus=0.25).remote(spec, TOKEN, None)
        mono_url = ray.get(mono.record.remote()).url
        reference = [complete(mono_url, p) for p in PROMPTS]
        outputs = [complete(cluster.router_url, p) for p in PROMPTS]
        records = cluster.records()
        metrics = [  # push: P counts the KV bytes; pull: D
            httpx.get(f"{r.url}/metrics", headers=route_headers(TOKEN, "/metrics"), timeout=10).text
            for r in records
        ]
        result = {
            "records": [
                {"role": r.role, "url": r.url, "node_ip": r.node_ip, "node_id": r.node_id}
                for r in records
            ],
            "reference": reference,
            "outputs": outputs,
            "metrics": metrics,
        }
        if mode_of_test == "leave":
            result["after_leave"] = _after_the_worker_leaves(cluster, out, reference)
        ray.kill(mono, no_restart=True)
    with open(out, "w") as f:
        json.dump(result, f)


def _after_the_worker_leaves(cluster: RayCluster, out: str, reference: list[str]) -> dict:
    """Tell the test to stop the worker node (a file), then wait until Ray has restarted
    decode elsewhere and the router admitted it; serve the prompts again."""
    Path(f"{out}.ready").touch()
    decode = next(r for r in cluster.records() if r.role == "decode")
    deadline = time.monotonic() + 300
    changes: list[str] = []
    while True:
        changes += cluster.changes()
        now = next(r for r in cluster.records() if r.role == "decode")
        if now.pid != decode.pid:
            break
        if time.monotonic() > deadline:
            raise SystemExit("decode was not restarted after its node left")
        time.sleep(0.5)
    cluster.wait_router_sees(2)
    outputs = [complete(cluster.router_url, p) for p in PROMPTS]
    return {
        "decode_before": decode.node_ip,
        "decode_after": now.node_ip,
        "restarts": now.restarts,
        "changes": changes + cluster.changes(),
        "equal": outputs == reference,
    }


if __name__ == "__main__":
    main(*sys.argv[1:7])
