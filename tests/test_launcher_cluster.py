"""`pdserve up` / `Cluster`: real processes (fake instances + the real router) by PID."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from pdserve.cluster.up_args import add_arguments, config_from_args
from pdserve.launcher import (
    Cluster,
    ClusterConfig,
    ClusterError,
    InstanceSpec,
    assign_cores,
    serve_command,
)
from pdserve.ports import EXIT_ADDRESS_IN_USE

pytestmark = pytest.mark.timeout(120)

FAKE = Path(__file__).with_name("test_router_fake_instance.py")
CORES = sorted(os.sched_getaffinity(0))


def fake_command(spec: InstanceSpec) -> list[str]:
    cmd = [sys.executable, str(FAKE), "--role", spec.role, "--port", str(spec.port)]
    cmd += ["--kv-transfer", spec.kv_transfer] if spec.kv_transfer else []
    return cmd + (["--threads", str(spec.threads)] if spec.threads else [])


def _gone(popen: subprocess.Popen[bytes]) -> bool:
    return popen.returncode is not None


def test_assign_cores_gives_each_instance_its_own_share() -> None:
    assert assign_cores(2, [0, 1]) == [(0,), (1,)]
    assert assign_cores(2, [4, 5, 6, 7, 8]) == [(4, 5), (6, 7)]
    assert assign_cores(1, [0, 1]) == [(0, 1)]
    assert assign_cores(3, [0, 1]) is None


def test_serve_command_flags() -> None:
    spec = InstanceSpec(
        "decode",
        0,
        "127.0.0.1",
        9001,
        "push",
        "nixl",
        "builtin:tiny",
        (1,),
        ("--max-num-seqs", "8"),
    )
    cmd = serve_command(spec)
    assert cmd[1:4] == ["-m", "pdserve", "serve"]
    joined = " ".join(cmd)
    for part in (
        "--role decode",
        "--kv-transfer push",
        "--transport nixl",
        "--model builtin:tiny",
        "--port 9001",
        "--threads 1",
        "--max-num-seqs 8",
    ):
        assert part in joined
    mono = InstanceSpec("both", 0, "127.0.0.1", 9002, None, "tcp", None, None, ("--threads", "4"))
    mono_cmd = serve_command(mono)
    assert "--kv-transfer" not in mono_cmd and "--role" not in mono_cmd
    assert mono_cmd.count("--threads") == 1


def test_up_arguments_map_to_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = "--kv-transfer pull --prefill 2 --decode 3 --no-pin -- --max-num-seqs 8"
    args = parser.parse_args(argv.split())
    config = config_from_args(args)
    assert (config.kv_transfer, config.num_prefill, config.num_decode) == ("pull", 2, 3)
    assert config.instance_args == ("--max-num-seqs", "8") and not config.pin_cores
    mono = config_from_args(parser.parse_args(["--monolithic"]))
    assert mono.monolithic
    routed = config_from_args(
        parser.parse_args(
            ["--kv-transfer", "push", "--policy", "load_aware", "--local-prefill-below", "64"]
        )
    )
    assert (routed.policy, routed.local_prefill_below) == ("load_aware", 64)
    assert config_from_args(parser.parse_args(["--monolithic"])).local_prefill_below is None
    traced = config_from_args(
        parser.parse_args(["--kv-transfer", "push", "--router-log-level", "debug"])
    )
    assert traced.router_log_level == "debug"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transfer", "push", "--policy", "fastest"])


def test_cores_narrow_what_is_shared_out() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--monolithic", "--cores"]
    assert config_from_args(parser.parse_args([*args, "0,1"])).cores == (0, 1)
    assert config_from_args(parser.parse_args(["--monolithic"])).cores is None
    for bad in ("x", "", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args([*args, bad])
    first = CORES[0]
    mono1 = Cluster(ClusterConfig(kv_transfer=None, cores=(first,))).instance_specs()
    assert [(s.role, s.cores, s.threads) for s in mono1] == [("both", (first,), 1)]
    # fewer cores than instances: every instance on all of them, none outside
    pd = Cluster(ClusterConfig(kv_transfer="push", cores=(first,))).instance_specs()
    assert [s.cores for s in pd] == [(first,), (first,)]
    unpinned = ClusterConfig(kv_transfer="push", cores=(first,), pin_cores=False)
    assert [s.cores for s in Cluster(unpinned).instance_specs()] == [None, None]
    missing = max(CORES) + 1
    with pytest.raises(ClusterError, match=rf"cores \[{missing}\] are not available"):
        Cluster(ClusterConfig(cores=(first, missing))).instance_specs()
    with pytest.raises(ValueError, match="at least one core"):
        ClusterConfig(cores=())


@pytest.mark.slow  # a 3-process cluster
def test_cluster_starts_serves_and_stops_processes_by_pid(tmp_path: Path) -> None:
    config = ClusterConfig(
        kv_transfer="push",
        log_dir=tmp_path,
        port=None,
        startup_timeout_s=60,
        local_prefill_below=0,
    )
    with Cluster(config, instance_command=fake_command) as cluster:
        procs = cluster.processes
        assert "--local-prefill-below 0" in (tmp_path / "router.log").read_text()
        assert [p.role for p in procs] == ["prefill", "decode", "router"]
        assert all(p.alive() for p in procs)
        resp = httpx.post(
            f"{cluster.router_url}/v1/completions",
            timeout=30,
            json={"model": "fake-model", "prompt": "hi", "max_tokens": 4, "stream": True},
        )
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        if len(CORES) >= 2:
            p, d = cluster.instances
            assert os.sched_getaffinity(p.pid) == {CORES[0]}
            assert os.sched_getaffinity(d.pid) == {CORES[1]}
            assert "--threads 1" in p.log_path.read_text().splitlines()[0]
            assert cluster.check_pinning() == []
            # The router shares P's core, so that D's core is D's alone.
            assert cluster.router is not None and cluster.router.cores == (CORES[0],)
            assert os.sched_getaffinity(cluster.router.pid) == {CORES[0]}
    assert all(_gone(p.popen) for p in procs)
    assert {f.name for f in tmp_path.iterdir()} == {"prefill-0.log", "decode-0.log", "router.log"}


@pytest.mark.slow  # a 3-process cluster
def test_cluster_notices_a_dead_child_and_stops_the_rest(tmp_path: Path) -> None:
    config = ClusterConfig(kv_transfer="pull", log_dir=tmp_path, port=None, startup_timeout_s=60)
    cluster = Cluster(config, instance_command=fake_command).start()
    try:
        victim = cluster.instances[1]
        os.kill(victim.pid, signal.SIGKILL)
        dead = cluster.wait(poll_s=0.05)
        assert dead is victim and dead.popen.returncode == -signal.SIGKILL
    finally:
        cluster.stop()
    assert all(_gone(p.popen) for p in cluster.processes)


def test_start_failure_reports_the_log_tail_and_stops_everything(tmp_path: Path) -> None:
    def crashing(spec: InstanceSpec) -> list[str]:
        if spec.role == "decode":
            return [sys.executable, "-c", "import sys; print('decode boom'); sys.exit(3)"]
        return fake_command(spec)

    cluster = Cluster(
        ClusterConfig(kv_transfer="push", log_dir=tmp_path, port=None, startup_timeout_s=60),
        instance_command=crashing,
    )
    with pytest.raises(ClusterError, match="decode-0") as info:
        cluster.start()
    assert "exited with code 3" in str(info.value) and "decode boom" in str(info.value)
    assert cluster.processes and all(_gone(p.popen) for p in cluster.processes)


def test_startup_timeout_is_bounded(tmp_path: Path) -> None:
    def silent(spec: InstanceSpec) -> list[str]:
        return [
            sys.executable,
            "-c",
            # The text is built at run time so that only the process's output, not the
            # `$ cmd` line the launcher writes to the same log, can put it in the error.
            "import time; print('load' + 'ing...', flush=True); time.sleep(60)",
        ]

    cluster = Cluster(
        ClusterConfig(
            kv_transfer=None, log_dir=tmp_path, port=None, startup_timeout_s=1.0, stop_timeout_s=5
        ),
        instance_command=silent,
    )
    with pytest.raises(ClusterError, match="not healthy in time") as info:
        cluster.start()
    assert "loading..." in str(info.value)
    assert all(_gone(p.popen) for p in cluster.processes)


def test_monolithic_cluster_has_no_router(tmp_path: Path) -> None:
    config = ClusterConfig(kv_transfer=None, log_dir=tmp_path, port=None, startup_timeout_s=60)
    with Cluster(config, instance_command=fake_command) as cluster:
        (inst,) = cluster.instances
        assert cluster.router is None and cluster.router_url == inst.url
        assert inst.role == "both"
        assert httpx.get(f"{cluster.router_url}/health").status_code == 200
        if len(CORES) >= 1:
            assert os.sched_getaffinity(inst.pid) == set(CORES)
    assert _gone(inst.popen)


def _run_up(
    tmp_path: Path | None, *argv: str, command: str = "fake_command"
) -> tuple[subprocess.Popen[str], list[str]]:
    """`pdserve up ARGV` in a subprocess with fake instances (started by `command`, a
    function of this module); returns once it is ready. `tmp_path` is its `--log-dir`
    (None: none given, `up` makes a temporary one)."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import pdserve.launcher as launcher, test_launcher_cluster as t;"
        f"launcher.serve_command = t.{command};"
        "from pdserve.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    cmd = [
        sys.executable,
        "-c",
        script,
        str(FAKE.parent),
        "up",
        *argv,
        "--port",
        "0",
        *(["--log-dir", str(tmp_path)] if tmp_path is not None else []),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    while not lines or "Ctrl-C stops everything" not in lines[-1]:
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise AssertionError("pdserve up ended early:\n" + "".join(lines))
        lines.append(line)
    return proc, lines


def _pids(lines: list[str]) -> dict[str, int]:
    rows = [line.split() for line in lines if " pid " in line]
    return {row[0]: int(row[row.index("pid") + 1]) for row in rows}


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow  # a 3-process cluster
def test_up_command_stops_everything_on_sigterm(tmp_path: Path) -> None:
    proc, lines = _run_up(tmp_path, "--kv-transfer", "push")
    pids = _pids(lines)
    try:
        assert set(pids) == {"prefill", "decode", "router"}
        assert any(line.strip().startswith("URL") for line in lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        _stop_if_hung(proc, pids)
    for pid in pids.values():
        _assert_gone(pid)


def _stop_if_hung(proc: subprocess.Popen[str], pids: dict[str, int]) -> None:
    """If `up` is still running (it hung), SIGKILL it and what it started, by PID."""
    if proc.poll() is not None:
        return
    proc.kill()
    proc.wait()
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def decode_ignores_sigterm(spec: InstanceSpec) -> list[str]:
    """Fake instances whose decode instance ignores SIGTERM (up has to SIGKILL it)."""
    if spec.role != "decode":
        return fake_command(spec)
    script = (
        "import runpy, sys, uvicorn;"
        "uvicorn.Server.handle_exit = lambda *args: None;"
        f"sys.argv = [{str(FAKE)!r}, '--role', 'decode', '--port', {str(spec.port)!r}];"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')"
    )
    return [sys.executable, "-c", script]


@pytest.mark.slow  # a 3-process cluster and the 10 s stop timeout
def test_a_second_signal_does_not_cut_the_stop_short(tmp_path: Path) -> None:
    proc, lines = _run_up(tmp_path, "--kv-transfer", "push", command="decode_ignores_sigterm")
    pids = _pids(lines)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout is not None
        while "pdserve up: stopping" not in (line := proc.stdout.readline()):
            assert line, "up ended before it said it was stopping"
        proc.send_signal(signal.SIGINT)  # while it waits for decode to give up
        status = proc.wait(60)
        rest = proc.stdout.read()
        assert status == 0, rest
        assert "decode-0" in rest and "ignored SIGTERM: killing it" in rest
    finally:
        _stop_if_hung(proc, pids)
    for pid in pids.values():
        _assert_gone(pid)


# -- ports: a child whose port was taken ------------------------------------------------------


def _fails_once_with_port_taken(marker: Path) -> Callable[[InstanceSpec], list[str]]:
    """Instance commands whose prefill exits as a taken port would make it, the first time."""

    def command(spec: InstanceSpec) -> list[str]:
        if spec.role != "prefill":
            return fake_command(spec)
        script = (
            "import os, runpy, sys;"
            f"first = not os.path.exists({str(marker)!r});"
            f"open({str(marker)!r}, 'a').write({str(spec.port)!r} + '\\n');"
            f"first and sys.exit({EXIT_ADDRESS_IN_USE});"
            f"sys.argv = [{str(FAKE)!r}, '--role', 'prefill', '--port', {str(spec.port)!r}];"
            f"runpy.run_path({str(FAKE)!r}, run_name='__main__')"
        )
        return [sys.executable, "-c", script]

    return command


@pytest.mark.slow  # two 3-process cluster starts
def test_a_child_finding_its_port_taken_makes_the_cluster_start_again(tmp_path: Path) -> None:
    marker = tmp_path / "prefill-starts"
    config = ClusterConfig(kv_transfer="push", log_dir=tmp_path, port=None, startup_timeout_s=60)
    with Cluster(config, instance_command=_fails_once_with_port_taken(marker)) as cluster:
        prefill = cluster.instance("prefill-0")
        assert httpx.get(f"{cluster.router_url}/health", timeout=5).status_code == 200
        assert prefill.alive() and str(httpx.URL(prefill.url).port) in marker.read_text()
    assert len(marker.read_text().split()) == 2  # the failed start, then the one that served
    assert all(_gone(p.popen) for p in cluster.processes)


def test_other_start_failures_are_not_retried(tmp_path: Path) -> None:
    marker = tmp_path / "decode-starts"

    def crashing(spec: InstanceSpec) -> list[str]:
        if spec.role != "decode":
            return fake_command(spec)
        script = f"import sys; open({str(marker)!r}, 'a').write('x\\n'); sys.exit(1)"
        return [sys.executable, "-c", script]

    config = ClusterConfig(kv_transfer="pull", log_dir=tmp_path, port=None, startup_timeout_s=60)
    with pytest.raises(ClusterError, match="exited with code 1") as info:
        Cluster(config, instance_command=crashing).start()
    assert not info.value.port_in_use and marker.read_text().split() == ["x"]


@pytest.mark.slow  # a 3-process cluster start
def test_a_taken_port_the_user_gave_is_reported_not_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ClusterConfig(kv_transfer="push", log_dir=tmp_path, port=port)
        cluster = Cluster(config, instance_command=fake_command)
        with pytest.raises(ClusterError, match=f"exited with code {EXIT_ADDRESS_IN_USE}") as info:
            cluster.start()
    assert info.value.args[0].startswith("router") and not info.value.port_in_use
    assert "starting again" not in caplog.text  # one start: the port was the user's
    assert all(_gone(p.popen) for p in cluster.processes)
