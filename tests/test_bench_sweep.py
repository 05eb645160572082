"""`pdserve bench sweep`: grid, per-point config and metadata, utilisation, the run loop
(with a stand-in benchmark), the sweep report, and one short live sweep on real clusters."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from pdserve.bench import sweep, sweep_args
from pdserve.bench.capacity import PrefillCapacity, utilisation
from pdserve.bench.metrics import (
    BenchResult,
    RequestRecord,
    compute_metrics,
    load_result,
    per_request_arrays,
)
from pdserve.bench.serve import BenchConfig
from pdserve.bench.sweep_report import (
    load_results_of,
    summary_text,
    sweep_table,
    write_sweep_report,
)
from pdserve.launcher import Cluster

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cfg(tmp_path: Path, **kw: object) -> sweep.SweepConfig:
    base = {
        "out_dir": tmp_path,
        "input_lens": (128, 512),
        "rates": (1.0, 4.0, math.inf),
        "modes": ("pull", "push"),
        "calibrate": False,
    }
    return sweep.SweepConfig(**{**base, **kw})  # type: ignore[arg-type]


# -- grid and per-point configuration -------------------------------------------------------


def test_grid_covers_every_mode_length_and_rate_once_mode_by_mode(tmp_path: Path) -> None:
    points = sweep.expand_grid(_cfg(tmp_path, modes=("pull", "push", "monolithic")))
    assert len(points) == 3 * 2 * 3 == len(set(points))
    assert [p.mode for p in points] == ["pull"] * 6 + ["push"] * 6 + ["monolithic"] * 6
    assert {(p.input_len, p.rate) for p in points if p.mode == "push"} == {
        (n, r) for n in (128, 512) for r in (1.0, 4.0, math.inf)
    }
    assert len({p.stem for p in points}) == len(points)
    assert sweep.SweepPoint("push", 512, 0.5).stem == "push-in512-r0.5"
    assert sweep.SweepPoint("pull", 128, math.inf).stem == "pull-in128-rinf"


def test_every_mode_gets_the_same_requests_at_a_point(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, seed=7)
    configs: dict[tuple[int, float], list[BenchConfig]] = {}
    for p in sweep.expand_grid(cfg):
        configs.setdefault((p.input_len, p.rate), []).append(
            sweep.bench_config(cfg, p, f"http://{p.mode}", None)
        )
    for pull, push in configs.values():
        assert (pull.seed, pull.random, pull.arrivals, pull.num_prompts) == (
            push.seed,
            push.random,
            push.arrivals,
            push.num_prompts,
        )
        assert (pull.base_url, push.base_url) == ("http://pull", "http://push")
    seeds = {cs[0].seed for cs in configs.values()}
    assert len(seeds) == len(configs)  # distinct prompts at distinct points
    assert sweep.point_seed(8, 128, 1.0) != sweep.point_seed(7, 128, 1.0)


def test_point_config_and_metadata(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, output_len=32, num_prompts=12, burstiness=0.5, num_warmups=2)
    point = sweep.SweepPoint("push", 512, 4.0)
    bc = sweep.bench_config(cfg, point, "http://127.0.0.1:9", 0.8125)
    assert (bc.random.input_len, bc.random.output_len, bc.num_prompts) == (512, 32, 12)
    assert (bc.arrivals.request_rate, bc.arrivals.burstiness) == (4.0, 0.5)
    assert bc.num_warmups == 2
    assert dict(bc.metadata) == {
        "mode": "push",
        "input_len": "512",
        "rate": "4",
        "prefill_util": "0.812",
    }
    unknown = dict(sweep.point_metadata(sweep.SweepPoint("pull", 128, math.inf), None))
    assert unknown == {"mode": "pull", "input_len": "128", "rate": "inf"}


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need --base-url"):
        _cfg(tmp_path, modes=("pull", "vllm"))
    with_url = _cfg(tmp_path, modes=("pull", "vllm"), base_urls=(("vllm", "http://h:1"),))
    assert with_url.base_url("vllm") == "http://h:1"
    assert with_url.base_url("pull") is None
    with pytest.raises(ValueError, match="mode is listed twice"):
        _cfg(tmp_path, modes=("push", "push"))
    with pytest.raises(ValueError, match="input length is listed twice"):
        _cfg(tmp_path, input_lens=(128, 128))
    with pytest.raises(ValueError, match="rate is listed twice"):
        _cfg(tmp_path, rates=(2.0, 2.0))
    with pytest.raises(ValueError):
        _cfg(tmp_path, rates=(0.0,))
    with pytest.raises(ValueError):
        _cfg(tmp_path, input_lens=())


def test_flags_parse_into_the_config() -> None:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    argv = "--input-len 256 1024 --request-rate 0.5 inf --modes push vllm "
    argv += "--base-url vllm=http://127.0.0.1:8100 --prefill-capacity 256=5000 1024=2500 "
    argv += "--out-dir /tmp/x --seed 3 -- --max-num-seqs 8"
    cfg = sweep_args.config_from_args(parser.parse_args(argv.split()))
    assert cfg.input_lens == (256, 1024)
    assert cfg.rates == (0.5, math.inf)
    assert cfg.modes == ("push", "vllm")
    assert cfg.base_urls == (("vllm", "http://127.0.0.1:8100"),)
    assert cfg.prefill_tok_s == ((256, 5000.0), (1024, 2500.0))
    assert cfg.instance_args == ("--max-num-seqs", "8")
    assert (cfg.out_dir, cfg.seed, cfg.model) == (Path("/tmp/x"), 3, "builtin:small")
    assert sweep.cluster_config(cfg, "push", Path("/tmp/l")).kv_transfer == "push"
    mono = sweep.cluster_config(cfg, "monolithic", Path("/tmp/l"))
    assert mono.monolithic and mono.model == "builtin:small"
    assert mono.instance_args == ("--max-num-seqs", "8")
    assert mono.cores is None  # every core the launcher may use


def test_mono1_is_one_monolithic_instance_on_the_prefill_core(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, modes=("push", "mono1"))
    mono1 = sweep.cluster_config(cfg, "mono1", Path("/tmp/l"))
    assert mono1.monolithic and mono1.cores == sweep.prefill_cores()
    if sweep.prefill_cores() is not None:  # pinned only with 2+ cores, as P is
        push = Cluster(sweep.cluster_config(cfg, "push", Path("/tmp/l"))).instance_specs()
        (spec,) = Cluster(mono1).instance_specs()
        assert spec.cores == push[0].cores and spec.threads == push[0].threads
        assert spec.role == "both" and push[0].role == "prefill"


# -- utilisation ----------------------------------------------------------------------------


def test_utilisation_is_offered_prefill_tokens_over_capacity() -> None:
    cap = PrefillCapacity(model="m", threads=1, tok_s={1000: 4000.0, 3000: 2000.0})
    assert utilisation(1000, 2.0, cap) == pytest.approx(0.5)
    assert utilisation(3000, 1.0, cap) == pytest.approx(1.5)
    assert cap.at(2000) == pytest.approx(3000.0)  # linear between measured lengths
    assert cap.at(500) == 4000.0 and cap.at(8000) == 2000.0  # flat beyond them
    assert utilisation(2000, 3.0, cap) == pytest.approx(2.0)
    assert utilisation(1000, math.inf, cap) == math.inf
    assert utilisation(1000, 1.0, None) is None
    empty = PrefillCapacity(model="m", threads=1, tok_s={})
    assert utilisation(1000, 1.0, empty) is None


def test_given_capacity_is_used_without_measuring(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, prefill_tok_s=((128, 1280.0),), calibrate=True)
    cap = sweep.prefill_capacity(cfg)
    assert cap is not None and cap.tok_s == {128: 1280.0}
    assert sweep.prefill_capacity(_cfg(tmp_path)) is None  # calibrate=False, none given


# -- the run loop, with a stand-in benchmark ------------------------------------------------


def _fake_result(bc: BenchConfig) -> BenchResult:
    """A result whose TTFT encodes its point (input_len x rate, halved for push)."""
    rate = bc.arrivals.request_rate
    ttft = bc.random.input_len * rate / 1000 / (2 if dict(bc.metadata)["mode"] == "push" else 1)
    recs = [
        RequestRecord(
            success=True,
            prompt_len=bc.random.input_len,
            output_len=4,
            ttft=ttft,
            itl=[0.01] * 3,
            latency=ttft + 0.03,
            arrival_time=i / rate,
            start_time=i / rate,
        )
        for i in range(bc.num_prompts or 1)
    ]
    return BenchResult(
        **msgspec.structs.asdict(compute_metrics(recs, 10.0)),
        **per_request_arrays(recs),
        date="20260101-000000",
        model_id="m",
        base_url=bc.base_url,
        endpoint=bc.endpoint,
        dataset_name="random",
        num_prompts=len(recs),
        input_len=bc.random.input_len,
        output_len=bc.random.output_len,
        request_rate=rate,
        burstiness=1.0,
        seed=bc.seed,
        metadata=dict(bc.metadata),
        start_time_unix=0.0,
    )


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[BenchConfig]:
    """Replace endpoints and benchmarks: no process starts. The point (push, 512, 4) raises,
    as an unusable endpoint would; every run's config is recorded."""
    seen: list[BenchConfig] = []

    @contextlib.contextmanager
    def fake_endpoint(cfg: sweep.SweepConfig, mode: str) -> Iterator[tuple[str, None]]:
        yield f"http://{mode}.invalid", None

    async def fake_run(bc: BenchConfig) -> BenchResult:
        seen.append(bc)
        meta = dict(bc.metadata)
        if (meta["mode"], meta["input_len"], meta["rate"]) == ("push", "512", "4"):
            raise sweep.EndpointError("all 1 warm-up requests failed; first: boom")
        return _fake_result(bc)

    monkeypatch.setattr(sweep, "endpoint", fake_endpoint)
    monkeypatch.setattr(sweep, "run_benchmark", fake_run)
    monkeypatch.setattr(sweep, "warm_up", lambda cfg, url: None)
    return seen


def test_sweep_runs_every_point_records_a_failure_and_goes_on(
    tmp_path: Path, stand_in: list[BenchConfig]
) -> None:
    cfg = _cfg(
        tmp_path, rates=(1.0, 4.0), num_prompts=3, prefill_tok_s=((128, 1024.0), (512, 1024.0))
    )
    lines: list[str] = []
    manifest, results = sweep.run_sweep(cfg, lines.append, command="pdserve bench sweep x")
    assert len(stand_in) == 8 and len(manifest.points) == 8
    assert len(results) == 7
    failed = [p for p in manifest.points if p.error]
    assert [(p.mode, p.input_len, p.rate) for p in failed] == [("push", 512, 4.0)]
    assert "boom" in failed[0].error and failed[0].result_file is None
    assert failed[0].prefill_util == pytest.approx(2.0)  # 4 req/s x 512 / 1024 tok/s
    for p in manifest.points:
        if p.error is None:
            saved = load_result(tmp_path / p.result_file)
            assert saved.metadata["mode"] == p.mode
            assert saved.metadata["input_len"] == str(p.input_len)
            assert float(saved.metadata["prefill_util"]) == pytest.approx(
                float(p.rate) * p.input_len / 1024, abs=1e-3
            )
            assert (p.completed, p.failed) == (3, 0)
    assert any("FAILED" in line and "push in=512 rate=4" in line for line in lines)
    assert sum(line.startswith("[") for line in lines) == 8
    assert not manifest.interrupted and manifest.command == "pdserve bench sweep x"


def test_a_mode_whose_endpoint_fails_marks_its_points_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in: list[BenchConfig]
) -> None:
    @contextlib.contextmanager
    def pull_wont_start(cfg: sweep.SweepConfig, mode: str) -> Iterator[tuple[str, None]]:
        if mode == "pull":
            raise sweep.ClusterError("prefill-0 (pid 1) exited with code 2 during start-up")
        yield f"http://{mode}.invalid", None

    monkeypatch.setattr(sweep, "endpoint", pull_wont_start)
    manifest, results = sweep.run_sweep(_cfg(tmp_path, rates=(1.0,)), lambda s: None)
    by_mode = {m: [p for p in manifest.points if p.mode == m] for m in ("pull", "push")}
    assert all("exited with code 2" in (p.error or "") for p in by_mode["pull"])
    assert len(by_mode["pull"]) == 2 and len(by_mode["push"]) == 2
    assert [p.error for p in by_mode["push"]] == [None, None]
    assert [r.metadata["mode"] for r in results] == ["push", "push"]


def test_ctrl_c_stops_the_sweep_and_keeps_what_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in: list[BenchConfig]
) -> None:
    exits: list[str] = []

    @contextlib.contextmanager
    def tracked(cfg: sweep.SweepConfig, mode: str) -> Iterator[tuple[str, None]]:
        try:
            yield f"http://{mode}.invalid", None
        finally:
            exits.append(mode)  # where the real one stops the cluster

    async def interrupted_after_two(bc: BenchConfig) -> BenchResult:
        if len(stand_in) == 2:
            raise KeyboardInterrupt
        stand_in.append(bc)
        return _fake_result(bc)

    monkeypatch.setattr(sweep, "endpoint", tracked)
    monkeypatch.setattr(sweep, "run_benchmark", interrupted_after_two)
    manifest, results = sweep.run_sweep(_cfg(tmp_path), lambda s: None)
    assert manifest.interrupted
    assert len(results) == len(manifest.points) == 2
    assert exits == ["pull"]  # the cluster in use was stopped, push never started


def test_interleaved_sweep_alternates_modes_at_each_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in: list[BenchConfig]
) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def tracked(cfg: sweep.SweepConfig, mode: str) -> Iterator[tuple[str, None]]:
        if mode == "monolithic":
            raise sweep.ClusterError("both-0 exited with code 1 during start-up")
        events.append(f"up {mode}")
        try:
            yield f"http://{mode}.invalid", None
        finally:
            events.append(f"down {mode}")

    monkeypatch.setattr(sweep, "endpoint", tracked)
    cfg = _cfg(tmp_path, rates=(1.0, 4.0), modes=("pull", "push", "monolithic"), interleave=True)
    manifest, results = sweep.run_sweep(cfg, lambda s: None)
    assert events == ["up pull", "up push", "down push", "down pull"]
    ran = [(bc.random.input_len, bc.arrivals.request_rate, dict(bc.metadata)["mode"])
           for bc in stand_in]  # fmt: skip
    assert ran == [
        (128, 1.0, "pull"), (128, 1.0, "push"),
        (128, 4.0, "push"), (128, 4.0, "pull"),
        (512, 1.0, "pull"), (512, 1.0, "push"),
        (512, 4.0, "push"), (512, 4.0, "pull"),
    ]  # fmt: skip
    mono = [p for p in manifest.points if p.mode == "monolithic"]
    assert len(mono) == 4 and all("exited with code 1" in (p.error or "") for p in mono)
    assert len(results) == 7  # push at (512, 4) raises in the stand-in
    assert len(manifest.points) == 12


# -- the report -----------------------------------------------------------------------------


def test_report_has_every_point_with_utilisation_ratios_and_plots(
    tmp_path: Path, stand_in: list[BenchConfig]
) -> None:
    cfg = _cfg(
        tmp_path, rates=(1.0, 4.0), num_prompts=2, prefill_tok_s=((128, 512.0), (512, 1024.0))
    )
    manifest, results = sweep.run_sweep(cfg, lambda s: None)
    files = write_sweep_report(manifest, results, tmp_path)
    text = files.markdown.read_text()
    table = sweep_table(manifest, results)
    assert table in text
    rows = table.splitlines()[2:]
    assert len(rows) == 8
    # input, rate, util, mode, ok / failed, req/s, TTFT p50 (the stand-in's: 128 x 1 ms)
    assert rows[0].startswith("| 128 | 1 | 0.25 | pull | 2 / 0 | 0.20 | 128.0 |")
    assert rows[1].startswith("| 128 | 1 | 0.25 | push | 2 / 0 | 0.20 | 64.0 |")
    assert "| 512 | 4 | 2.00 | push | point failed |" in table
    assert "push in=512 rate=4: EndpointError" in text
    assert "TTFT p50 push/pull" in text  # the ratio table of pdserve.bench.report
    assert "push/mono1" not in text  # no such mode ran
    names = {p.name for p in files.plots}
    assert {"report_ttft.png", "report_tpot.png", "report_ratio.png"} <= names
    for plot in files.plots:
        assert plot.read_bytes()[:8] == PNG_MAGIC
    reread = msgspec.json.decode(files.manifest.read_bytes(), type=sweep.SweepManifest)
    assert reread == manifest
    assert len(load_results_of(reread, tmp_path)) == 7


def test_summary_compares_push_with_each_monolithic_floor_that_ran(
    tmp_path: Path, stand_in: list[BenchConfig]
) -> None:
    cfg = _cfg(tmp_path, rates=(1.0,), modes=("push", "mono1", "monolithic"), num_prompts=2)
    manifest, results = sweep.run_sweep(cfg, lambda s: None)
    text = summary_text(manifest, results)
    for floor in ("mono1", "monolithic"):
        head = next(line for line in text.splitlines() if f"TTFT p50 push/{floor}" in line)
        rows = text.split(head)[1].splitlines()[2:4]
        # the stand-in halves TTFT for push: 128 x 1 ms / 2 over 128 x 1 ms
        assert rows[0].startswith("| 128 | 1 | 0.50 |"), rows
        assert rows[1].startswith("| 512 | 1 | 0.50 |"), rows
    assert "push / pull" not in text  # pull did not run


# -- live: real clusters --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_live_sweep_on_local_clusters(tmp_path: Path) -> None:
    """1 input length x 1 rate x 4 prompts on monolithic, pull and push clusters of the
    tiny built-in model, with the prefill capacity measured: every point completes every
    request, and the report, JSONs and plots are written."""
    cfg = sweep.SweepConfig(
        out_dir=tmp_path,
        input_lens=(64,),
        rates=(8.0,),
        modes=("monolithic", "pull", "push"),
        output_len=8,
        num_prompts=4,
        model="builtin:tiny",
        disable_tqdm=True,
    )
    lines: list[str] = []
    manifest, files = sweep.sweep_and_report(cfg, "test", lines.append)
    assert manifest.capacity is not None and manifest.capacity.tok_s[64] > 0
    assert [(p.mode, p.error, p.completed, p.failed) for p in manifest.points] == [
        ("monolithic", None, 4, 0),
        ("pull", None, 4, 0),
        ("push", None, 4, 0),
    ]
    assert all(float(p.prefill_util) > 0 for p in manifest.points)
    for p in manifest.points:
        result = load_result(tmp_path / p.result_file)
        assert result.metadata["mode"] == p.mode and result.completed == 4
    assert files.markdown.exists() and (tmp_path / "report.md").exists()
    assert {"report_ttft.png", "report_tpot.png", "report_ratio.png"} <= {
        p.name for p in files.plots
    }
    assert any(line.startswith("plot: ") for line in lines)
    logs = tmp_path / "logs"
    assert {d.name for d in logs.iterdir()} == {"monolithic", "pull", "push"}
