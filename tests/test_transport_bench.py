"""Smoke test of `pdserve bench transport` (tiny grid): it runs and its JSON is complete."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench import transport_args as bench


@pytest.mark.process  # the bench's target end runs in a process of its own
def test_bench_transport_json(capsys) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--transport", "tcp", "--sizes-mb", "1", "--descs", "4,16", "--iters", "2", "--json"]
    )
    assert bench.main_from_args(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["transport"] == "tcp" and out["op"] == "write"
    assert [(p["size_bytes"], p["descs"]) for p in out["points"]] == [(1 << 20, 4), (1 << 20, 16)]
    for p in out["points"]:
        assert p["transport_gbps"] > 0 and p["memcpy_gbps"] > 0 and p["raw_nixl_gbps"] is None
        assert p["ratio_vs_memcpy"] == p["transport_gbps"] / p["memcpy_gbps"]
    assert set(out["idle_cpu_s"]) == {"initiator", "target"}
    assert out["path"] in ("Unix-domain socket (same host)", "TCP")
