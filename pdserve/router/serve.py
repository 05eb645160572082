"""`pdserve router`: run the OpenAI-compatible P/D router in front of running instances.

Its flags, and the `RouterCommand` built from them: pdserve.router.serve_args."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from pdserve.config import LogLevel
from pdserve.httpd.bootstrap import LISTEN_BACKLOG, serve_app
from pdserve.options import option
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.membership import MembershipSource
from pdserve.server.exposure import router_warning

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # open client streams get this long on SIGTERM/SIGINT


@dataclass(frozen=True)
class RouterProcess:
    """How the `pdserve router` process logs."""

    log_level: LogLevel = option("info", help="log verbosity (default: %(default)s)")
    access_log: bool = option(False, help="log every HTTP request")


@dataclass(frozen=True)
class RouterCommand:
    """What `pdserve router` runs (built from its flags by pdserve.router.serve_args)."""

    router: RouterConfig
    process: RouterProcess = RouterProcess()


def main(cfg: RouterCommand) -> int:
    """Serve until interrupted."""
    config, proc = cfg.router, cfg.process
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
