"""`pdserve serve`: one instance (engine thread + OpenAI-compatible HTTP front end).

Start-up order: bind the port (fails fast if it is taken, before minutes of model
loading), load the model, start the engine thread, then serve HTTP. On SIGTERM/SIGINT
uvicorn stops accepting connections and drains (up to `SHUTDOWN_GRACE_S`), then the engine
thread is stopped and the command returns 0.

This module is imported by `pdserve --help`, so it imports nothing heavy at module level.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdserve.config import (
    API_KEY_ENV,
    HTTP_GROUP,
    ConnectorConfig,
    EngineConfig,
    LogLevel,
    ServerConfig,
    TransportConfig,
)
from pdserve.faults import NO_FAULTS, Faults
from pdserve.httpd.bootstrap import LISTEN_BACKLOG, serve_app
from pdserve.options import option
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.server.exposure import serve_warning
from pdserve.vllm import serve as vllm_serve

if TYPE_CHECKING:
    from pdserve.engine.handle import EngineHandle

__all__ = ["API_KEY_ENV", "ServeCommand", "ServeProcess", "main"]

log = logging.getLogger("pdserve.serve")

SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long to finish on SIGTERM


# The connector's and transport's configs of a P/D role; None for a monolithic instance.
PdConfigs = tuple[ConnectorConfig, TransportConfig] | None


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


@dataclass(frozen=True)
class ServeCommand:
    """One `pdserve serve` instance on pdserve's engine: what `main` runs (built from the
    flags by pdserve.server.serve_args). The address `pd` tells peers is resolved at start
    (`advertised`): a wildcard `--kv-host` without `--kv-advertise-host` fails there, after
    the exposure warning, with the other flags that cannot work (exit status 2)."""

    engine: EngineConfig
    server: ServerConfig
    process: ServeProcess = ServeProcess()
    pd: PdConfigs = None


def main(cfg: ServeCommand | vllm_serve.VllmServeCommand, faults: Faults = NO_FAULTS) -> int:
    """Run one instance until SIGTERM/SIGINT; returns the exit status. A `VllmServeCommand`
    makes this process the vLLM instance (pdserve.vllm). `faults`: what a test breaks in it
    (pdserve.faults; tests/fault_serve.py), never set from a flag."""
    if isinstance(cfg, vllm_serve.VllmServeCommand):  # this process becomes vLLM's server
        _log_to_stderr(cfg.instance.log_level)
        return vllm_serve.main(cfg)
    _log_to_stderr(cfg.process.log_level)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout otherwise
    engine_cfg = replace(cfg.engine, faults=faults)
    server_cfg = cfg.server
    if cfg.pd is not None:
        connector = cfg.pd[0]
        warning = serve_warning(
            connector.role, server_cfg.host, connector.side_host, connector.cluster_token
        )
        if warning:
            log.warning("%s", warning)
    try:
        # Bound before the model loads, listening only after: until then connections are
        # refused (health probes fail fast) instead of queueing.
        sock = bind_socket(server_cfg.host, server_cfg.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", server_cfg.host, server_cfg.port, exc)
        return EXIT_ADDRESS_IN_USE if is_address_in_use(exc) else 1
    with sock:
        log.info("loading %s", engine_cfg.model.model)
        engine = _start_engine(cfg, engine_cfg, faults)
        if isinstance(engine, int):
            return engine
        try:
            if not _listen(sock):
                return EXIT_ADDRESS_IN_USE
            _serve_http(engine, server_cfg, sock, cfg.process.log_level)
        finally:
            engine.shutdown()
            log.info("engine stopped")
    return 0


def _log_to_stderr(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _start_engine(
    cfg: ServeCommand, engine_cfg: EngineConfig, faults: Faults
) -> EngineHandle | int:
    """The running engine (in a thread, or with `--engine-process` in a child process), or
    the exit status if it cannot be built (logged): 2 for flags that cannot work (a wildcard
    `--kv-host` without `--kv-advertise-host` among them), 98 for a taken side-channel port."""
    # Imported here: torch (in-thread) loads only once the HTTP port is ours.
    from pdserve.engine.core_client import CoreStartError
    from pdserve.transfer.transport import BackendUnavailableError

    try:
        pd = advertised(cfg.pd)
        if pd is not None:  # the transfer faults a test asked for (pdserve.faults)
            pd = (replace(pd[0], faults=faults), pd[1])
        if cfg.process.engine_process:
            return _engine_process(engine_cfg, pd, cfg.process.log_level)
        return _engine_thread(engine_cfg, pd)
    except (ValueError, FileNotFoundError, BackendUnavailableError) as exc:  # the message says why
        log.error("%s", exc)
        return 2
    except CoreStartError as exc:
        log.error("engine core: %s", exc)
        return exc.status
    except OSError as exc:
        if not is_address_in_use(exc):
            raise
        log.error("%s", exc)  # the side channel's port (its message names it)
        return EXIT_ADDRESS_IN_USE


def advertised(pd: PdConfigs) -> PdConfigs:
    """`pd` with the address peers are told filled in: `--kv-advertise-host`, else
    `--kv-host`; ValueError for a wildcard `--kv-host` without it (peers cannot dial it)."""
    if pd is None:
        return None
    # Imported here: the transport package pulls numpy, and `serve --help` should not.
    from pdserve.transfer.transport.handshake import advertised_host

    connector, transport = pd
    host = advertised_host(connector.side_host, connector.side_advertise_host)
    return replace(connector, side_advertise_host=host), replace(transport, advertise_host=host)


def _engine_thread(cfg: EngineConfig, pd: PdConfigs) -> EngineHandle:
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.engine import LLMEngine
    from pdserve.transfer.factory import build_factory

    engine = LLMEngine.from_config(cfg, build_factory(*pd) if pd is not None else None)
    handle = AsyncEngine(engine)
    handle.start()
    return handle


def _engine_process(cfg: EngineConfig, pd: PdConfigs, log_level: str) -> EngineHandle:
    from pdserve.engine.core_client import EngineCoreClient

    connector, transport = pd if pd is not None else (None, None)
    client = EngineCoreClient(cfg, connector, transport, log_level=log_level)
    client.start()
    return client


def _listen(sock: socket.socket) -> bool:
    """Start listening on `sock`; False (logged) if another socket bound the same port
    meanwhile and listens on it (see `pdserve.ports.bind_socket`)."""
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        if not is_address_in_use(exc):
            raise
        host, port = sock.getsockname()[:2]
        log.error("cannot listen on %s:%d: another process listens there", host, port)
        return False
    return True


def _serve_http(
    async_engine: EngineHandle, cfg: ServerConfig, sock: socket.socket, log_level: str
) -> None:
    """Serve the app on `sock` until SIGTERM/SIGINT, then return normally (pdserve.httpd:
    running requests get `SHUTDOWN_GRACE_S`, then the engine is stopped so the rest end with
    an explicit error instead of a cut connection)."""
    from pdserve.server.app import create_app

    app = create_app(async_engine, cfg)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    log.info("serving %s at http://%s:%d/v1", app.state.serving.model_name, url_host, port)
    serve_app(app, sock, log_level, grace_s=SHUTDOWN_GRACE_S, on_grace_over=async_engine.shutdown)
