"""Simulated results are bench results: same workload draw, same JSON, same report."""

from __future__ import annotations

import argparse
import math

import numpy as np

from pdserve.bench import report
from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.dataset import RandomDatasetConfig
from pdserve.bench.metrics import load_result, save_result
from pdserve.bench.serve import BenchConfig, build_requests, release_offsets, workload_rngs
from pdserve.sim import sim_args
from pdserve.sim.cluster_config import ClusterConfig
from pdserve.sim.profiles import load_hardware, load_model, load_software
from pdserve.sim.run import SimConfig, run_sim, workload

WL = BenchConfig(
    random=RandomDatasetConfig(input_len=2048, output_len=16, range_ratio=0.5),
    num_prompts=12,
    arrivals=ArrivalConfig(request_rate=4.0, burstiness=0.5),
    seed=7,
)


def _qwen(mode: str, wl: BenchConfig = WL) -> SimConfig:
    cluster = ClusterConfig(
        load_model("qwen3-32b"),
        load_hardware("h200-p5en"),
        load_software("vllm-gpu"),
        mode=mode,
        tp_prefill=4,
        tp_decode=4,
    )
    return SimConfig(cluster, wl)


def test_the_simulator_draws_the_bench_workload() -> None:
    data_rng, _, arrival_rng = workload_rngs(WL.seed)
    expected = build_requests(WL, data_rng)
    offsets = release_offsets(WL, expected, arrival_rng)
    requests, sim_offsets = workload(WL)
    assert [r.prompt_len for r in requests] == [r.prompt_len for r in expected]
    assert [r.output_len for r in requests] == [r.output_len for r in expected]
    assert np.array_equal(sim_offsets, offsets)
    result = run_sim(_qwen("push"))
    assert result.input_lens == [r.prompt_len for r in expected]
    assert result.arrival_times == offsets.tolist()


def test_result_json_round_trips_and_the_report_reads_it(tmp_path) -> None:
    results = [run_sim(_qwen(mode)) for mode in ("pull", "push")]
    for r in results:
        assert r.metadata["source"] == "sim"
        assert r.completed == 12 and r.failed == 0
        save_result(r, tmp_path / f"{r.metadata['mode']}.json")
    loaded = report.load_results(sorted(tmp_path.glob("*.json")))
    assert [r.metadata["mode"] for r in loaded] == ["pull", "push"]
    assert loaded[0].median_ttft_ms == results[0].median_ttft_ms
    files = report.write_report(loaded, tmp_path / "report")
    assert files.markdown.read_text().count("| pull |") == 1
    assert any(p.name == "report_ratio.png" for p in files.plots)
    assert report.ratio_rows(loaded)[0][0] == 2048


def test_max_concurrency_caps_requests_in_flight() -> None:
    import dataclasses

    capped = dataclasses.replace(WL, max_concurrency=2, arrivals=ArrivalConfig(math.inf))
    result = run_sim(_qwen("push", capped))
    assert result.max_concurrent_requests <= 2
    assert max(result.queue_times) > 0


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim_args.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_sweep_writes_results_and_report(tmp_path, capsys) -> None:
    args = _args(
        "--tp", "4", "--sweep", "--input-lens", "1024", "4096", "--rates", "1", "4",
        "--num-prompts", "10", "--output-len", "8", "--out", str(tmp_path), "--disable-tqdm",
    )  # fmt: skip
    assert sim_args.main_from_args(args) == 0
    saved = sorted(tmp_path.glob("sim-*.json"))
    assert len(saved) == 2 * 2 * 2
    result = load_result(tmp_path / "sim-pull-in4096-r4.json")
    assert result.metadata["mode"] == "pull" and result.metadata["tp_prefill"] == "4"
    assert (tmp_path / "report.md").is_file()
    assert "push/pull" in capsys.readouterr().out


def test_cli_overrides_and_errors(tmp_path, capsys) -> None:
    out = tmp_path / "one.json"
    args = _args(
        "--mode", "push", "--num-prompts", "4", "--save-result", str(out),
        "--set", "software.layerwise_push=true", "hardware.flops_efficiency=0.3",
    )  # fmt: skip
    assert sim_args.main_from_args(args) == 0
    assert load_result(out).metadata["mode"] == "push"
    assert sim_args.main_from_args(_args("--set", "software.nope=1")) == 1
    assert "unknown field" in capsys.readouterr().err
    assert sim_args.main_from_args(_args("--list-profiles")) == 0
    assert "qwen3-32b" in capsys.readouterr().out


def test_sweep_points_use_the_bench_sweep_seed_rule() -> None:
    from pdserve.bench.sweep import point_seed
    from pdserve.sim.sweep import point_config

    base = _qwen("pull")
    point = point_config(base, 4096, 0.5, "push")
    assert point.workload.seed == point_seed(WL.seed, 4096, 0.5)
    assert point.cluster.mode == "push" and point.workload.random.input_len == 4096
    assert point_seed(0, 1024, 2.0) == point_seed(0, 1024, 2.0) != point_seed(0, 1024, 4.0)


def test_simulated_and_measured_results_share_the_header() -> None:
    """Same workload config: the fields that describe the run are the bench's own."""
    from pdserve.bench.serve import result_header

    result = run_sim(_qwen("push"))
    requests, offsets = workload(WL)
    header = result_header(
        WL, requests, offsets, model="qwen3-32b", base_url="sim://", start_time_unix=0.0
    )
    for key, value in header.items():
        if key not in ("date", "metadata"):
            assert getattr(result, key) == value, key
    assert result.metadata["source"] == "sim" and result.backend == "pdserve-sim"
