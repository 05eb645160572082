"""`pdserve serve --engine vllm`: become a vLLM instance (see `pdserve.vllm.instance`).

The flags of `pdserve serve` that mean the same for vLLM are mapped onto it (model, dtype,
max model length, seed, served name, host, port, KV cache GiB, threads, log level, role,
transfer mode, transport, engine id, side channel); `--vllm-arg` passes anything else to
vLLM as given (the mapping: pdserve.server.serve_args). pdserve's scheduler flags are not
mapped (vLLM keeps its own defaults).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from pdserve.options import add_options, option
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.vllm.instance import (
    Connector,
    Engine,
    VllmInstanceConfig,
    VllmNotFound,
    command,
    environment,
    find_vllm_python,
)

log = logging.getLogger("pdserve.serve")
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own; keeps the key off the logged command line


@dataclass(frozen=True)
class EngineChoice:
    """Which engine `pdserve serve` runs, and the flags only `--engine vllm` reads."""

    engine: Engine = option(
        "pdserve",
        group="engine",
        help="pdserve: pdserve's own engine; vllm: run vLLM's OpenAI server as this instance "
        "(same role, transfer mode and ports; needs a Hugging Face model directory)",
    )
    connector: Connector = option(
        "pdserve",
        group="engine",
        help="--engine vllm, P/D roles: pdserve's KV transfer inside vLLM, or vLLM's own "
        "NixlConnector (pull) / NixlPushConnector (push) (default: %(default)s)",
    )
    vllm_python: str | None = option(
        None,
        group="engine",
        metavar="PATH",
        help="python of a venv with vLLM (default: the checkout's .venv-vllm/bin/python if it "
        "exists, else this python if it can import vllm)",
    )
    vllm_arg: tuple[str, ...] = option(
        (),
        group="engine",
        append=True,
        metavar="ARG",
        help="one argument for vLLM's command line, as given (repeat for each)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine choice and the flags only `--engine vllm` reads."""
    add_options(parser, EngineChoice)


@dataclass(frozen=True)
class VllmServeCommand:
    """`pdserve serve --engine vllm`: the vLLM instance, the python that runs it (None:
    `find_vllm_python`'s default) and the API key it requires (None: none), which travels in
    vLLM's environment, never on its command line. Built from the flags by
    pdserve.server.serve_args."""

    instance: VllmInstanceConfig
    vllm_python: str | None = None
    api_key: str | None = None


def main(cfg: VllmServeCommand) -> int:
    """Replace this process with the vLLM instance; returns only on an error (its status)."""
    try:
        python = find_vllm_python(cfg.vllm_python)
    except VllmNotFound as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr, flush=True)
        return 2
    instance = cfg.instance
    try:  # a taken port: say so now, with the status `pdserve up` retries on
        bind_socket(instance.host, instance.port).close()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", instance.host, instance.port, exc)
        return EXIT_ADDRESS_IN_USE if is_address_in_use(exc) else 1
    env = environment(instance, dict(os.environ))
    if cfg.api_key:
        env[API_KEY_ENV] = cfg.api_key
    cmd = command(instance, python)
    print(f"pdserve serve: exec {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(python, cmd, env)
    return 1  # not reached
