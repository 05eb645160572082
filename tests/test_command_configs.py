"""Commands whose flags are declared on their own configs: the parsed flags make the config
the command runs on (the commands' own runs are slow or need hardware)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.bench import capacity, engine, make_checkpoint, make_checkpoint_args, transport
from pdserve.options import add_options, from_args


def _parse(add, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_bench_engine_flags() -> None:
    default = from_args(engine.EngineBenchConfig, _parse(engine.add_arguments, []))
    assert default.model == ("builtin:tiny", "builtin:small") and default.batch == (1, 8, 32)
    assert default.budget() == 2048 and not default.json
    argv = ["--model", "builtin:tiny", "--batch", "2", "4", "--prefill-len", "4096", "--json"]
    cfg = from_args(engine.EngineBenchConfig, _parse(engine.add_arguments, argv))
    assert (cfg.model, cfg.batch, cfg.budget(), cfg.json) == (("builtin:tiny",), (2, 4), 4096, True)
    argv = ["--max-num-batched-tokens", "512"]
    assert from_args(engine.EngineBenchConfig, _parse(engine.add_arguments, argv)).budget() == 512


def test_bench_transport_flags() -> None:
    default = from_args(transport.TransportBenchConfig, _parse(transport.add_arguments, []))
    assert default.raw and default.timeout_s == 30.0 and default.desc_counts() == [16, 256, 4096]
    argv = ["--transport", "nixl", "--no-raw", "--timeout", "5", "--sizes-mb", "0.5,2"]
    cfg = from_args(transport.TransportBenchConfig, _parse(transport.add_arguments, argv))
    assert (cfg.transport, cfg.raw, cfg.timeout_s) == ("nixl", False, 5.0)
    assert cfg.sizes() == [transport.MB // 2, 2 * transport.MB]
    with pytest.raises(SystemExit):
        _parse(transport.add_arguments, ["--op", "copy"])


def test_make_checkpoint_flags() -> None:
    argv = ["--out", "d", "--layers", "2", "--dtype", "float32", "--force"]
    cfg = make_checkpoint_args.config_from_args(_parse(make_checkpoint.add_arguments, argv))
    assert cfg.out == Path("d") and cfg.force
    assert cfg.shape == make_checkpoint.CheckpointShape(layers=2, dtype="float32")
    with pytest.raises(SystemExit):  # --out is required
        _parse(make_checkpoint.add_arguments, [])


def test_capacity_child_flags_are_those_the_parent_passes() -> None:
    def add(parser: argparse.ArgumentParser) -> None:
        add_options(parser, capacity.CapacityRun)

    argv = ["--model", "m", "--threads", "2", "--repeats", "1", "--input-len", "64", "128"]
    run = from_args(capacity.CapacityRun, _parse(add, argv))
    assert run == capacity.CapacityRun(model="m", input_len=(64, 128), threads=2, repeats=1)


def test_up_mode_and_ray_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import main, parse_args

    assert main(["up", "--kv-transfer", "push", "--planner"]) == 2  # before starting anything
    assert "--planner and --ray-address need --ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --monolithic and --kv-transfer exclude each other
        parse_args(["up", "--monolithic", "--kv-transfer", "push"])
    args = parse_args(["up", "--monolithic", "--ray"])
    assert (args.monolithic, args.ray, args.planner) == (True, True, False)


def test_demo_flags_shape_its_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pdserve import demo

    seen = []

    def fake(cfg, command, progress):  # records the sweep instead of running it
        seen.append((cfg, command))
        raise SystemExit(0)

    monkeypatch.setattr(demo, "sweep_and_report", fake)
    with pytest.raises(SystemExit):
        demo.main(["--out-dir", str(tmp_path), "--monolithic"])
    cfg, command = seen[0]
    assert cfg.out_dir == tmp_path and cfg.modes == ("pull", "push", "monolithic")
    assert command.endswith(f"--out-dir {tmp_path} --monolithic")
    with pytest.raises(SystemExit):
        demo.main([])
    assert seen[1][0].out_dir == demo.DEMO_DIR and seen[1][0].modes == ("pull", "push")
