"""Faults are a seam tests construct (pdserve.faults), not flags: `pdserve serve` has none,
and the test-only entry point (tests/fault_serve.py) hands its `--faults` to the server."""

from __future__ import annotations

import pytest

import pdserve.server.serve as serve
from pdserve.cli import parse_args
from pdserve.faults import NO_FAULTS, Faults
from pdserve.launcher import InstanceSpec
from tests import fault_serve

GONE = (
    ("--fault-step-delay-ms", "40"),
    ("--push-register-delay", "1"),
    ("--push-finish-delay", "1"),
    ("--fault-transfer-every", "3"),
    ("--pull-read-on-engine-loop",),
)
BASE = ["serve", "--role", "decode", "--kv-transfer", "pull"]


@pytest.mark.parametrize("flag", GONE)
def test_serve_has_no_fault_or_measurement_flags(flag: tuple[str, ...]) -> None:
    parse_args([*BASE, "--no-push-layerwise"])  # a real flag in the same place parses
    with pytest.raises(SystemExit):
        parse_args([*BASE, *flag])


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[serve.ServeCommand, Faults]]:
    seen: list[tuple[serve.ServeCommand, Faults]] = []
    monkeypatch.setattr(serve, "main", lambda cfg, faults=NO_FAULTS: seen.append((cfg, faults)))
    return seen


def test_the_entry_point_gives_serve_its_faults_and_flags(monkeypatch) -> None:
    seen = _captured(monkeypatch)
    faults = Faults(step_delay_s=0.04, fail_transfer_every=3)
    argv = fault_serve.command(faults, ["--role", "prefill", "--kv-transfer", "push"])[2:]
    fault_serve.main(argv)
    [(cfg, got)] = seen
    assert got == faults
    assert cfg.pd is not None and (cfg.pd[0].role, cfg.pd[0].mode) == ("prefill", "push")


@pytest.mark.parametrize("text", ['{"step_delay": 1}', '{"step_delay_s": "x"}', "[1]", "{"])
def test_bad_faults_are_refused(monkeypatch, text: str) -> None:
    seen = _captured(monkeypatch)
    with pytest.raises(SystemExit):
        fault_serve.main(["--faults", text])
    assert seen == []


def test_the_launcher_command_runs_the_instance_through_the_entry_point() -> None:
    spec = InstanceSpec("decode", 0, "127.0.0.1", 8100, "push", "tcp", None, None, ())
    cmd = fault_serve.instance_command(Faults(register_delay_s=3.0))(spec)
    assert cmd[1] == fault_serve.__file__
    assert cmd[2:4] == [
        "--faults",
        '{"step_delay_s":0.0,"register_delay_s":3.0,"finish_delay_s":0.0,"fail_transfer_every":0}',
    ]
    assert cmd[4:8] == ["--role", "decode", "--kv-transfer", "push"]
