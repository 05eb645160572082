"""`pdserve router`: run the OpenAI-compatible P/D router in front of running instances."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from pdserve.httpd.bootstrap import LISTEN_BACKLOG, serve_app
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.router.app import create_app
from pdserve.router.config import (
    DEFAULT_LOCAL_PREFILL_BELOW,
    POLICY_NAMES,
    RouterConfig,
    normalize_url,
)
from pdserve.router.membership import MembershipSource
from pdserve.router.vllm_legs import PrefillPeer
from pdserve.server.exposure import router_warning
from pdserve.transfer.release import TOKEN_ENV, token_from_env
from pdserve.vllm.instance import CONNECTORS, ENGINES

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # open client streams get this long on SIGTERM/SIGINT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve router` (one-to-one with `RouterConfig`)."""
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill instance URL(s); repeat or list several",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="decode instance URL(s); repeat or list several",
    )
    parser.add_argument(
        "--kv-transfer",
        choices=("pull", "push"),
        required=True,
        help="pull: P then D, sequential; push: both legs at once",
    )
    parser.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default="round_robin",
        help="instance selection per role (default: %(default)s; docs/router.md)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="pdserve",
        help="the instances' engine: pdserve, or vLLM's OpenAI server (vLLM's"
        " kv_transfer_params passed from P to D untouched; no /kv/info, /load or releases;"
        " docs/router.md) (default: %(default)s)",
    )
    parser.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="pdserve",
        help="--engine vllm: the instances' KV connector: pdserve's or vLLM's NIXL ones"
        " (push sends both legs at once with either; pull sends D's leg after P's answer)"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--prefill-peer",
        nargs="+",
        action="extend",
        type=_peer,
        default=[],
        metavar="ENGINE_ID@HOST:PORT",
        help="--engine vllm: each prefill instance's KV connector (engine id and side"
        " channel), in the order of --prefill; push needs them",
    )
    parser.add_argument(
        "--local-prefill-below",
        type=int,
        default=DEFAULT_LOCAL_PREFILL_BELOW,
        metavar="N",
        help="prompts of fewer than N tokens are prefilled on the decode instance itself,"
        " skipping prefill and transfer (0: never; default: %(default)s, the crossover"
        " measured on 1P1D CPU; docs/router.md)",
    )
    parser.add_argument(
        "--cluster-token",
        default=None,
        help="the instances' cluster token: the router signs its P/D legs and releases and"
        " proves it on /kv/info and /load polls; /router/instances then needs a proof of it"
        f" too (default: ${TOKEN_ENV}; instances with a token refuse a router without it)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="required from clients and sent to the instances (default: $PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="bound on P's answer, D's first token and each gap in D's stream"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` of parsed `pdserve router` arguments."""
    return RouterConfig(
        prefill_urls=tuple(normalize_url(u) for u in args.prefill),
        decode_urls=tuple(normalize_url(u) for u in args.decode),
        kv_transfer=args.kv_transfer,
        policy=args.policy,
        engine=args.engine,
        connector=args.connector,
        prefill_peers=tuple(args.prefill_peer),
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        cluster_token=token_from_env(args.cluster_token),
        request_timeout_s=args.request_timeout,
        local_prefill_below=args.local_prefill_below,
    )


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """After parsing: the combination makes a `RouterConfig` (`parser.error` otherwise)."""
    try:
        config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def _peer(text: str) -> PrefillPeer:
    try:
        return PrefillPeer.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    config = config_from_args(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    urls = (*config.prefill_urls, *config.decode_urls)
    if warning := router_warning(config.host, urls, config.cluster_token):
        log.warning("%s", warning)
    try:
        sock = bind_socket(config.host, config.port)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        return EXIT_ADDRESS_IN_USE if is_address_in_use(exc) else 1
    with sock:
        serve_on(config, sock, args.log_level, args.access_log)
    return 0


def serve_on(
    config: RouterConfig,
    sock: socket.socket,
    log_level: str,
    access_log: bool = False,
    membership: MembershipSource | None = None,
) -> None:
    """Serve the router app on a listening `sock` until SIGTERM/SIGINT (main thread only;
    `pdserve.cluster` runs it in an actor's thread, with a membership source), then return.
    Open client streams must not hold a shutdown (Ctrl-C, `pdserve up` stopping) long: they
    get `SHUTDOWN_GRACE_S` (pdserve.httpd)."""
    app = create_app(config, membership)
    serve_app(app, sock, log_level, grace_s=SHUTDOWN_GRACE_S, access_log=access_log)
