"""`pdserve serve --engine vllm` and `pdserve up --engine vllm`: the command lines, kv
transfer configs and environments they build (no vLLM needed; tests/vllm/ runs them)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_router_fake_instance import wait_for

from pdserve.cli import parse_args
from pdserve.cluster.up_args import config_from_args
from pdserve.launcher import InstanceSpec, ManagedProcess, prefill_peer, serve_command
from pdserve.server.serve_args import main_from_args, vllm_config_from_args
from pdserve.vllm import instance
from pdserve.vllm.instance import (
    VllmInstanceConfig,
    VllmNotFound,
    command,
    environment,
    find_vllm_python,
    kv_transfer_config,
)

MODEL = "/ckpt"


def _cfg(**kw: object) -> VllmInstanceConfig:
    return VllmInstanceConfig(model=MODEL, **kw)  # type: ignore[arg-type]


def _conf_on_command_line(cmd: list[str]) -> dict | None:
    if "--kv-transfer-config" not in cmd:
        return None
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_pdserve_connector_config(mode: str, transport: str) -> None:
    cfg = _cfg(role="prefill", kv_transfer=mode, transport=transport, side_port=5601)
    assert kv_transfer_config(cfg) == {
        "kv_connector": "PdserveConnector",
        "kv_connector_module_path": "pdserve.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "mode": mode,
            "transport": transport,
            "side_host": "127.0.0.1",
            "side_port": 5601,
        },
    }


@pytest.mark.parametrize(
    ("mode", "role", "connector", "kv_role"),
    [
        ("pull", "prefill", "NixlConnector", "kv_producer"),
        ("pull", "decode", "NixlConnector", "kv_consumer"),
        ("push", "prefill", "NixlPushConnector", "kv_producer"),
        ("push", "decode", "NixlPushConnector", "kv_consumer"),
    ],
)
def test_nixl_connector_config(mode: str, role: str, connector: str, kv_role: str) -> None:
    cfg = _cfg(role=role, kv_transfer=mode, connector="nixl", engine_id=f"{role}-0")
    conf = kv_transfer_config(cfg)
    assert conf == {
        "kv_connector": connector,
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "engine_id": f"{role}-0",
    }
    assert _conf_on_command_line(command(cfg, "py")) == conf


def test_monolithic_has_no_kv_transfer_config() -> None:
    cmd = command(_cfg(port=8123, max_model_len=2048), "py")
    assert _conf_on_command_line(cmd) is None
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert "--no-enable-prefix-caching" in cmd


def test_nixl_side_channel_and_cores_in_the_environment() -> None:
    cfg = _cfg(role="decode", connector="nixl", side_port=5602, threads=1, kv_cache_gib=0.25)
    env = environment(cfg, {"PYTHONPATH": "/x"}, cores={3, 2})
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2"  # --threads 1: the first of its cores
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # whole GiB, at least one
    paths = env["PYTHONPATH"].split(":")
    assert paths[-1] == "/x" and Path(paths[0], "pdserve", "vllm", "instance.py").is_file()


def test_pdserve_connector_leaves_vllms_nixl_settings_alone() -> None:
    env = environment(_cfg(role="prefill", side_port=5602), {}, cores={0, 1})
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"


def test_builtin_models_are_refused() -> None:
    with pytest.raises(ValueError, match="make-checkpoint"):
        VllmInstanceConfig(model="builtin:tiny")


def test_find_vllm_python(tmp_path: Path) -> None:
    with pytest.raises(VllmNotFound, match="no such file"):
        find_vllm_python(str(tmp_path / "nope"))
    venv_python = tmp_path / ".venv-vllm" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.touch()
    assert find_vllm_python(None, tmp_path) == str(venv_python)
    assert find_vllm_python(str(venv_python)) == str(venv_python)


def test_find_vllm_python_without_a_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instance, "_imports_vllm", lambda python: False)
    with pytest.raises(VllmNotFound, match="--vllm-python"):
        find_vllm_python(None, tmp_path)
    monkeypatch.setattr(instance, "_imports_vllm", lambda python: python == sys.executable)
    assert find_vllm_python(None, tmp_path) == sys.executable


def test_the_vllm_probe_is_not_fooled_by_a_folder_called_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "vllm").mkdir()  # what tests/vllm is to a test run from tests/
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    has_vllm = importlib.util.find_spec("vllm") is not None and (
        importlib.util.find_spec("vllm").origin is not None  # type: ignore[union-attr]
    )
    assert instance._imports_vllm(sys.executable) == has_vllm


def test_serve_flags_map_onto_the_vllm_instance() -> None:
    args = parse_args(
        ["serve", "--engine", "vllm", "--connector", "nixl", "--model", MODEL, "--role",
         "decode", "--kv-transfer", "push", "--side-channel-port", "5605", "--port", "9001",
         "--dtype", "half", "--threads", "2", "--engine-id", "d0", "--vllm-arg=--enforce-eager"]
    )  # fmt: skip
    cfg = vllm_config_from_args(args).instance
    assert (cfg.role, cfg.kv_transfer, cfg.connector) == ("decode", "push", "nixl")
    assert (cfg.port, cfg.side_port, cfg.dtype, cfg.threads) == (9001, 5605, "float16", 2)
    assert cfg.engine_id == "d0" and cfg.extra_args == ("--enforce-eager",)


def test_serve_engine_vllm_with_a_builtin_model_exits_2(capsys: pytest.CaptureFixture) -> None:
    args = parse_args(["serve", "--engine", "vllm", "--vllm-python", sys.executable])
    assert main_from_args(args) == 2
    assert "make-checkpoint" in capsys.readouterr().err


def test_up_builds_vllm_instances_and_router_peers() -> None:
    args = parse_args(
        ["up", "--engine", "vllm", "--connector", "nixl", "--kv-transfer", "push", "--model",
         MODEL, "--vllm-python", "/v/python"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.engine, config.connector, config.vllm_python) == ("vllm", "nixl", "/v/python")
    spec = InstanceSpec(
        "prefill", 0, "127.0.0.1", 8100, "push", "tcp", MODEL, (0,), (), side_port=5601,
        engine="vllm", connector="nixl", vllm_python="/v/python",
    )  # fmt: skip
    cmd = serve_command(spec)
    flags = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert flags["--engine"] == "vllm" and flags["--connector"] == "nixl"
    assert flags["--engine-id"] == "prefill-0" and flags["--vllm-python"] == "/v/python"
    assert flags["--side-channel-port"] == "5601" and flags["--threads"] == "1"
    assert prefill_peer(spec) == "prefill-0@127.0.0.1:5601"


def test_up_pdserve_engine_commands_are_unchanged() -> None:
    spec = InstanceSpec("decode", 0, "127.0.0.1", 8100, "pull", "tcp", None, None, ())
    assert "--engine" not in serve_command(spec)


def _spec(engine: str) -> InstanceSpec:
    return InstanceSpec("prefill", 0, "127.0.0.1", 1, "pull", "tcp", MODEL, None, (), 2,
                        engine=engine)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("engine", ["vllm", "pdserve"])
def test_leftovers_of_a_dead_vllm_instance_are_killed(tmp_path: Path, engine: str) -> None:
    # A stand-in for vLLM's API server whose child (the engine core) outlives it.
    pid_file = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    popen = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    proc = ManagedProcess("prefill-0", "prefill", "http://x", popen, None, tmp_path / "log")
    proc.spec = _spec(engine)
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        child = int(pid_file.read_text())
        popen.kill()
        popen.wait()
        proc.kill_leftovers()
        if engine == "vllm":
            wait_for(lambda: not _running(child))
        else:
            assert _running(child)  # pdserve's own engine process dies on its own (PDEATHSIG)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
