"""Builds an instance's KV connector from its flags: role, mode, transport.

`pdserve serve` calls `add_transfer_arguments` on its parser and hands
`connector_factory(args)` to the engine, which calls it once the KV cache exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
from typing import TYPE_CHECKING

from pdserve.config import ConnectorConfig, TransportConfig
from pdserve.transfer.messages import Compat

if TYPE_CHECKING:
    from pdserve.kv.cache import KVCache
    from pdserve.model.loader import LoadedModel
    from pdserve.transfer.adapter import EngineSide
    from pdserve.transfer.connector import KVConnector


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """The P/D flags of `pdserve serve`."""
    g = parser.add_argument_group("P/D disaggregation")
    g.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="both: monolithic instance; prefill/decode: one side of a P/D pair "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-transfer",
        choices=["pull", "push"],
        default="pull",
        help="how KV moves from prefill to decode; must match the router (default: %(default)s)",
    )
    g.add_argument(
        "--transport",
        choices=["tcp", "nixl"],
        default="tcp",
        help="KV transport backend; nixl needs `pip install nixl-cu12` (default: %(default)s)",
    )
    g.add_argument(
        "--engine-id", default=None, help="this instance's id among peers (default: random)"
    )
    g.add_argument(
        "--cluster-token",
        default=os.environ.get("PDSERVE_CLUSTER_TOKEN"),
        help="shared secret peers must prove (challenge-response, never sent); "
        "default: $PDSERVE_CLUSTER_TOKEN",
    )
    g.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="address the side channel and transport listen on (default: %(default)s)",
    )
    g.add_argument(
        "--kv-advertise-host",
        default=None,
        help="address peers are told to reach the side channel and transport at (in "
        "/kv/info, pull params, the transport card); required when --kv-host is a wildcard "
        "such as 0.0.0.0 (default: --kv-host)",
    )
    g.add_argument(
        "--side-channel-port",
        type=int,
        default=0,
        help="side-channel port (default: a free one, see GET /kv/info)",
    )
    g.add_argument(
        "--kv-port",
        type=int,
        default=0,
        help="port of the KV transport's listener: tcp's data connections, NIXL's metadata "
        "exchange (UCX opens its own data connections); fix it when a firewall sits between "
        "hosts (default: a free one)",
    )
    g.add_argument(
        "--kv-lease",
        type=float,
        default=30.0,
        help="prefill: seconds finished blocks are held for a decode instance "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-recv-timeout",
        type=float,
        default=120.0,
        help="decode: seconds to wait for a prompt's KV before failing the "
        "request (default: %(default)s)",
    )
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=10.0,
        help="a transfer to an unresponsive peer fails after this many seconds "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--no-push-layerwise",
        dest="push_layerwise",
        action="store_false",
        help="push: write a prompt's KV in one go after prefill instead of layer by "
        "layer as each layer finishes",
    )
    g.add_argument(
        "--pull-read-on-engine-loop",
        action="store_true",
        help="pull, decode: run the claim and the READ in the engine loop, so every running "
        "stream waits for them, as classic pull does; only to measure what push and "
        "pdserve's reader threads save (default: a reader thread per prefill instance)",
    )
    _add_limit_arguments(g)
    g.add_argument("--push-register-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    g.add_argument("--push-finish-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    g.add_argument("--fault-transfer-every", type=int, default=0, help=argparse.SUPPRESS)


def _default(name: str) -> object:
    """The default of ConnectorConfig field `name` (declared there, once)."""
    return next(f.default for f in dataclasses.fields(ConnectorConfig) if f.name == name)


# (flag, ConnectorConfig field, type, help): limits on work for transfers nobody finishes.
_LIMITS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--kv-unknown-transfer-grace",
        "unknown_transfer_grace_s",
        float,
        "prefill, push: seconds a decode registration for a transfer with no prompt here "
        "waits for its prompt before the decode instance is told the transfer is unknown",
    ),
    (
        "--kv-max-waiting-per-peer",
        "max_waiting_per_peer",
        int,
        "decode: legs queued or waiting for KV from one prefill instance at most; more are "
        "refused (kv_overloaded)",
    ),
    (
        "--kv-max-waiting-fraction",
        "max_waiting_kv_fraction",
        float,
        "decode: fraction of the KV blocks that requests waiting for remote KV may reserve; "
        "a leg over it waits in the queue",
    ),
    (
        "--kv-max-unclaimed-fraction",
        "max_unclaimed_hold_fraction",
        float,
        "prefill: fraction of the KV blocks held for transfers no decode instance has "
        "claimed or registered for; new prefill legs over it are refused (kv_overloaded)",
    ),
    (
        "--kv-handshake-tries",
        "handshake_tries",
        int,
        "decode: handshake attempts (backing off, within the handshake timeout) before "
        "giving up on an address",
    ),
    (
        "--kv-unreachable-cooldown",
        "unreachable_cooldown_s",
        float,
        "decode: seconds legs naming an address given up on fail at once, without dialing",
    ),
)


def _add_limit_arguments(g: argparse._ArgumentGroup) -> None:
    for flag, name, kind, text in _LIMITS:
        g.add_argument(
            flag,
            dest=name,
            type=kind,
            default=_default(name),
            metavar="N" if kind is int else "X",
            help=f"{text} (default: %(default)s)",
        )


def kv_advertise_host(args: argparse.Namespace) -> str:
    """The address peers are told for this instance's side channel and transport; raises
    ValueError (at start-up, before the model loads) for a wildcard `--kv-host` without
    `--kv-advertise-host`."""
    # Imported here: the transport package pulls numpy, and `serve --help` should not.
    from pdserve.transfer.transport.handshake import advertised_host

    return advertised_host(args.kv_host, args.kv_advertise_host)


def connector_config(args: argparse.Namespace) -> ConnectorConfig:
    return ConnectorConfig(
        role=args.role,
        mode=args.kv_transfer,
        engine_id=args.engine_id or f"{args.role}-{secrets.token_hex(4)}",
        side_host=args.kv_host,
        side_port=args.side_channel_port,
        side_advertise_host=kv_advertise_host(args),
        cluster_token=args.cluster_token,
        lease_s=args.kv_lease,
        recv_timeout_s=args.kv_recv_timeout,
        push_register_delay_s=args.push_register_delay,
        push_finish_delay_s=args.push_finish_delay,
        fault_transfer_every=args.fault_transfer_every,
        push_layerwise=args.push_layerwise,
        pull_on_engine_loop=args.pull_read_on_engine_loop,
        **{name: getattr(args, name) for _, name, _, _ in _LIMITS},
    )


def transport_config(args: argparse.Namespace) -> TransportConfig:
    return TransportConfig(
        kind=args.transport,
        host=args.kv_host,
        port=args.kv_port,
        advertise_host=kv_advertise_host(args),
        cluster_token=args.cluster_token,
        timeout_s=args.transfer_timeout,
    )


def compat_of(kv: KVCache, loaded: LoadedModel) -> Compat:
    return Compat(
        model=loaded.name,
        dtype=str(kv.dtype).removeprefix("torch."),
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        block_size=kv.block_size,
        layout="LKBTHD",  # [layers, k|v, blocks, tokens, heads, head_dim]
    )


def make_connector_factory(args: argparse.Namespace):
    """A factory for the engine, or None for a monolithic instance."""
    if args.role == "both":
        return None
    return build_factory(connector_config(args), transport_config(args))


def build_factory(ccfg: ConnectorConfig, tcfg: TransportConfig):
    """The engine's connector factory for a P/D role (`ccfg.mode` picks pull or push)."""

    def factory(kv: KVCache, engine: EngineSide, loaded: LoadedModel) -> KVConnector:
        from pdserve.transfer.descriptors import OneRegion
        from pdserve.transfer.kv_transport import open_kv_transport
        from pdserve.transfer.pull import PullConnector
        from pdserve.transfer.push import PushConnector

        regions = OneRegion.of(kv)
        transport = open_kv_transport(tcfg, ccfg.engine_id, regions, ccfg.fault_transfer_every)
        cls = PushConnector if ccfg.mode == "push" else PullConnector
        return cls(ccfg, regions, engine, compat_of(kv, loaded), transport)

    return factory
