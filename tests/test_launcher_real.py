"""`pdserve up` with real `pdserve serve` instances on the built-in tiny model.

These run only once `pdserve serve` accepts the flags the launcher passes (the P/D test
needs `--role`, `--kv-transfer` and `--transport`); until then they skip and say why.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Cluster, ClusterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _serve_flags() -> set[str]:
    try:
        module = importlib.import_module("pdserve.server.serve_args")
    except ModuleNotFoundError:
        return set()
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return {opt for action in parser._actions for opt in action.option_strings}


def _require(*flags: str) -> None:
    missing = [f for f in ("--port", "--host", *flags) if f not in _serve_flags()]
    if missing:
        pytest.skip(f"pdserve serve does not accept {', '.join(missing)} yet")


def _complete(url: str) -> str:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_monolithic_cluster_serves_a_completion(tmp_path: Path) -> None:
    _require()
    config = ClusterConfig(kv_transfer=None, port=None, log_dir=tmp_path)
    with Cluster(config) as cluster:
        (inst,) = cluster.instances
        assert inst.alive()
        assert _complete(cluster.router_url)
    assert inst.popen.returncode is not None
