"""The flags of `pdserve serve` and the configs built from them.

Each flag is declared once, on the config field it sets (pdserve.config; `ServeProcess` below
for the two that only this command reads); this module lists them on the parser in `--help`'s
order and turns the parsed namespace into configs. The namespace goes no further: the
engine, the connector and the server get configs.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass

from pdserve.config import (
    HTTP_GROUP,
    PD_GROUP,
    CacheConfig,
    ConnectorConfig,
    EngineConfig,
    LogLevel,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    TransportConfig,
)
from pdserve.options import add_options, from_args, option
from pdserve.server import vllm_forms
from pdserve.vllm import serve as vllm_serve


@dataclass(frozen=True)
class ServeProcess:
    """How the `pdserve serve` process runs its engine, and how much it logs."""

    engine_process: bool = option(
        False,
        help="run the engine loop in a child process with its own interpreter, so the HTTP "
        "front end (parsing, formatting and sending streams) never holds the GIL the engine "
        "needs; costs one IPC hop per step. Off by default: on 2 cores it did not improve "
        "TPOT (docs/results.md, 'engine loop in its own process')",
    )
    log_level: LogLevel = option(
        "info", group=HTTP_GROUP, help="log verbosity (default: %(default)s)"
    )


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


def process_from_args(args: argparse.Namespace) -> ServeProcess:
    return from_args(ServeProcess, args)


def pd_configs_from_args(
    args: argparse.Namespace,
) -> tuple[ConnectorConfig, TransportConfig] | None:
    """The connector's and transport's configs of a P/D role; None for a monolithic
    instance. ValueError (at start-up, before the model loads) for a wildcard `--kv-host`
    without `--kv-advertise-host`."""
    if args.role == "both":
        return None
    # Imported here: the transport package pulls numpy, and `serve --help` should not.
    from pdserve.transfer.transport.handshake import advertised_host

    advertise = advertised_host(args.kv_host, args.kv_advertise_host)
    connector = from_args(
        ConnectorConfig,
        args,
        engine_id=args.engine_id or f"{args.role}-{secrets.token_hex(4)}",
        side_advertise_host=advertise,
    )
    return connector, from_args(TransportConfig, args, advertise_host=advertise)
