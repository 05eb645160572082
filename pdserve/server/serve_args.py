"""The flags of `pdserve serve` and the configs built from them.

Each flag is declared once, on the config field it sets (pdserve.config; `ServeProcess` in
pdserve.server.serve for the two that only this command reads); this module lists them on
the parser in `--help`'s order and turns the parsed namespace into the command's config
(`ServeCommand`, or `VllmServeCommand` with `--engine vllm`). The namespace goes no further:
`pdserve.server.serve.main` and everything below it get configs.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Sequence

from pdserve.config import (
    PD_GROUP,
    CacheConfig,
    ConnectorConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    TransportConfig,
)
from pdserve.faults import NO_FAULTS, Faults
from pdserve.options import add_options, from_args
from pdserve.server import serve, vllm_forms
from pdserve.server.serve import PdConfigs, ServeCommand, ServeProcess
from pdserve.vllm import serve as vllm_serve
from pdserve.vllm.instance import VllmInstanceConfig
from pdserve.vllm.serve import VllmServeCommand

# ConnectorConfig's flags that bound work for transfers nobody finishes.
_LIMITS = (
    "unknown_transfer_grace_s",
    "max_waiting_per_peer",
    "max_waiting_kv_fraction",
    "max_unclaimed_hold_fraction",
    "handshake_tries",
    "unreachable_cooldown_s",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve serve`."""
    add_options(parser, ModelConfig)
    add_options(parser, ServerConfig, only=("served_model_name",))
    add_options(parser, CacheConfig)
    add_options(parser, SchedulerConfig)
    add_options(parser, EngineConfig)
    add_options(parser, ServeProcess, only=("engine_process",))
    add_options(parser, ServerConfig, only=("host", "port", "api_key"))
    add_options(parser, ServeProcess, only=("log_level",))
    parser.epilog = (
        "Requests: /v1/completions defaults to max_tokens=16; /v1/chat/completions without "
        "max_tokens may generate up to the rest of the context. Extensions to OpenAI's "
        "parameters: top_k, ignore_eos, stop_token_ids, kv_transfer_params."
    )
    _add_pd_arguments(parser)
    vllm_serve.add_arguments(parser)
    vllm_forms.add_arguments(parser)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (name: value, as vLLM's --config); flags on the command line "
        "override it",
    )


def _add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(PD_GROUP)
    add_options(g, ConnectorConfig, only=("role", "mode"))
    add_options(g, TransportConfig, only=("kind",))
    add_options(g, ConnectorConfig, only=("engine_id", "cluster_token", "side_host"))
    add_options(g, ConnectorConfig, only=("side_advertise_host", "side_port"))
    add_options(g, TransportConfig, only=("port",))
    add_options(g, ConnectorConfig, only=("lease_s", "recv_timeout_s"))
    add_options(g, TransportConfig, only=("timeout_s",))
    add_options(g, ConnectorConfig, only=("push_layerwise",))
    add_options(g, ConnectorConfig, only=_LIMITS)


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """After parsing: vLLM's forms folded into pdserve's flags (`parser.error` if bad)."""
    vllm_forms.apply(args, parser)


def main_from_args(args: argparse.Namespace, faults: Faults = NO_FAULTS) -> int:
    """`pdserve serve` on its parsed flags (`faults`: tests/fault_serve.py's); 2 when
    `--engine vllm` has no vLLM instance of them."""
    if args.engine != "vllm":
        return serve.main(config_from_args(args), faults)
    try:
        cfg = vllm_config_from_args(args)
    except ValueError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr, flush=True)
        return 2
    return serve.main(cfg, faults)


def config_from_argv(argv: Sequence[str]) -> ServeCommand | VllmServeCommand:
    """The config of a `pdserve serve` command line (its flags, without `serve`); exits
    with a usage error as the command would (pdserve.cluster's instance actors)."""
    parser = argparse.ArgumentParser(prog="pdserve serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_args(args, parser)
    return config_from_args(args)


def config_from_args(args: argparse.Namespace) -> ServeCommand | VllmServeCommand:
    """The command's config: pdserve's instance, or with `--engine vllm` vLLM's
    (ValueError if the flags describe none)."""
    if args.engine == "vllm":
        return vllm_config_from_args(args)
    engine, server = configs_from_args(args)
    return ServeCommand(engine, server, from_args(ServeProcess, args), pd_configs_from_args(args))


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The frozen configs described by the parsed flags."""
    engine = from_args(
        EngineConfig,
        args,
        model=from_args(ModelConfig, args),
        cache=from_args(CacheConfig, args),
        scheduler=from_args(SchedulerConfig, args),
    )
    # The connector's token (flag or $PDSERVE_CLUSTER_TOKEN): the front end checks legs and
    # routes for routers with it. A monolithic instance has no connector to guard.
    token = args.cluster_token if args.role != "both" else None
    return engine, from_args(ServerConfig, args, cluster_token=token)


def pd_configs_from_args(args: argparse.Namespace) -> PdConfigs:
    """The connector's and transport's configs of a P/D role; None for a monolithic
    instance. The address peers are told is `--kv-advertise-host` as given (None without
    it): `pdserve.server.serve.advertised` resolves it at start-up."""
    if args.role == "both":
        return None
    connector = from_args(
        ConnectorConfig, args, engine_id=args.engine_id or f"{args.role}-{secrets.token_hex(4)}"
    )
    return connector, from_args(TransportConfig, args, advertise_host=args.kv_advertise_host)


def vllm_config_from_args(args: argparse.Namespace) -> VllmServeCommand:
    """The vLLM instance the parsed `pdserve serve` flags describe (ValueError if none)."""
    instance = VllmInstanceConfig(
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
    return VllmServeCommand(instance, vllm_python=args.vllm_python, api_key=args.api_key or None)
