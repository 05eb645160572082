"""`pdserve serve --engine vllm`: become a vLLM instance (see `pdserve.vllm.instance`).

The flags of `pdserve serve` that mean the same for vLLM are mapped onto it (model, dtype,
max model length, seed, served name, host, port, KV cache GiB, threads, log level, role,
transfer mode, transport, engine id, side channel); `--vllm-arg` passes anything else to
vLLM as given. pdserve's scheduler flags are not mapped (vLLM keeps its own defaults).
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


def config_from_args(args: argparse.Namespace) -> VllmInstanceConfig:
    """The vLLM instance the parsed `pdserve serve` flags describe (ValueError if none)."""
    return VllmInstanceConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        role=args.role,
        kv_transfer=args.kv_transfer,
        connector=args.connector,
        transport=args.transport,
        engine_id=args.engine_id,
        side_host=args.kv_host,
        side_port=args.side_channel_port or None,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        served_model_name=args.served_model_name,
        kv_cache_gib=args.kv_cache_memory,
        threads=args.threads,
        log_level=args.log_level,
        extra_args=tuple(args.vllm_arg),
    )


def main(args: argparse.Namespace) -> int:
    """Replace this process with the vLLM instance; returns only on an error (its status)."""
    try:
        cfg = config_from_args(args)
        python = find_vllm_python(args.vllm_python)
    except (ValueError, VllmNotFound) as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr, flush=True)
        return 2
    try:  # a taken port: say so now, with the status `pdserve up` retries on
        bind_socket(cfg.host, cfg.port).close()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, exc)
        return EXIT_ADDRESS_IN_USE if is_address_in_use(exc) else 1
    env = environment(cfg, dict(os.environ))
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    cmd = command(cfg, python)
    print(f"pdserve serve: exec {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(python, cmd, env)
    return 1  # not reached
