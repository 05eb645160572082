"""`pdserve bench serve --cpus`: the client pins itself before it starts any thread."""

from __future__ import annotations

import argparse
import os

import pytest

from pdserve.bench import serve, serve_args
from tests.procs import free_port


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-2", {0, 1, 2}), ("0,2", {0, 2}), ("1, 3-4", {1, 3, 4})],
)
def test_cpu_lists_parse_as_taskset_takes_them(text: str, cpus: set[int]) -> None:
    assert serve.parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "0,,1", "1-a"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a CPU list"):
        serve.parse_cpu_list(text)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_client_pins_itself_first(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, cpus)))
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: the run ends at once
    args = _args("--base-url", url, "--cpus", "0", "--num-prompts", "1", "--disable-tqdm")
    assert serve_args.main_from_args(args) == 1
    assert calls == [(0, frozenset({0}))]
    assert _args().cpus is None  # default: anywhere


def test_cpus_outside_the_machine_are_a_clear_error(capsys) -> None:
    args = _args("--base-url", "http://127.0.0.1:9", "--cpus", "100000")
    assert serve_args.main_from_args(args) == 1
    assert "pdserve bench serve:" in capsys.readouterr().err
