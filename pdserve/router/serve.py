"""`pdserve router`: run the OpenAI-compatible P/D router in front of running instances."""

from __future__ import annotations

import argparse
import logging
import socket
from dataclasses import dataclass

from pdserve.config import LogLevel
from pdserve.httpd.bootstrap import LISTEN_BACKLOG, serve_app
from pdserve.options import add_options, from_args, option
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.membership import MembershipSource
from pdserve.server.exposure import router_warning
from pdserve.transfer.release import token_from_env

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # open client streams get this long on SIGTERM/SIGINT


@dataclass(frozen=True)
class RouterProcess:
    """How the `pdserve router` process logs."""

    log_level: LogLevel = option("info", help="log verbosity (default: %(default)s)")
    access_log: bool = option(False, help="log every HTTP request")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve router` (declared on `RouterConfig` and `RouterProcess`)."""
    add_options(parser, RouterConfig)
    add_options(parser, RouterProcess)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` of parsed `pdserve router` arguments."""
    return from_args(
        RouterConfig,
        args,
        api_key=args.api_key or None,
        cluster_token=token_from_env(args.cluster_token),
    )


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """After parsing: the combination makes a `RouterConfig` (`parser.error` otherwise)."""
    try:
        config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    config = config_from_args(args)
    proc = from_args(RouterProcess, args)
    logging.basicConfig(
        level=proc.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
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
        serve_on(config, sock, proc.log_level, proc.access_log)
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
