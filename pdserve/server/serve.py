"""`pdserve serve`: one instance (engine thread + OpenAI-compatible HTTP front end).

Start-up order: bind the port (fails fast if it is taken, before minutes of model
loading), load the model, start the engine thread, then serve HTTP. On SIGTERM/SIGINT
uvicorn stops accepting connections and drains (up to `SHUTDOWN_GRACE_S`), then the engine
thread is stopped and the command returns 0.

This module is imported by `pdserve --help`, so it imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from dataclasses import replace
from typing import TYPE_CHECKING

from pdserve.config import API_KEY_ENV, ConnectorConfig, EngineConfig, ServerConfig, TransportConfig
from pdserve.faults import NO_FAULTS, Faults
from pdserve.httpd.bootstrap import LISTEN_BACKLOG, serve_app
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.server.exposure import serve_warning
from pdserve.server.serve_args import (
    ServeProcess,
    add_arguments,
    check_args,
    configs_from_args,
    pd_configs_from_args,
    process_from_args,
)
from pdserve.vllm import serve as vllm_serve

if TYPE_CHECKING:
    from pdserve.engine.handle import EngineHandle

__all__ = ["API_KEY_ENV", "add_arguments", "check_args", "configs_from_args", "main"]

log = logging.getLogger("pdserve.serve")

SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long to finish on SIGTERM


def main(args: argparse.Namespace, faults: Faults = NO_FAULTS) -> int:
    """Run one instance until SIGTERM/SIGINT; returns the exit status. `faults`: what a test
    breaks in it (pdserve.faults; tests/fault_serve.py), never set from a flag."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.engine == "vllm":  # this process becomes the vLLM instance (pdserve.vllm)
        return vllm_serve.main(args)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout otherwise
    engine_cfg, server_cfg = configs_from_args(args)
    engine_cfg = replace(engine_cfg, faults=faults)
    proc = process_from_args(args)
    if warning := serve_warning(args.role, args.host, args.kv_host, args.cluster_token):
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
        engine = _start_engine(proc, engine_cfg, args, faults)
        if isinstance(engine, int):
            return engine
        try:
            if not _listen(sock):
                return EXIT_ADDRESS_IN_USE
            _serve_http(engine, server_cfg, sock, proc.log_level)
        finally:
            engine.shutdown()
            log.info("engine stopped")
    return 0


def _start_engine(
    proc: ServeProcess, cfg: EngineConfig, args: argparse.Namespace, faults: Faults
) -> EngineHandle | int:
    """The running engine (in a thread, or with `--engine-process` in a child process), or
    the exit status if it cannot be built (logged): 2 for flags that cannot work, 98 for a
    taken side-channel port. `args` gives the P/D configs, built here so that a bad
    `--kv-host` is one of the flags that cannot work."""
    # Imported here: torch (in-thread) loads only once the HTTP port is ours.
    from pdserve.engine.core_client import CoreStartError
    from pdserve.transfer.transport import BackendUnavailableError

    try:
        pd = pd_configs_from_args(args)
        if pd is not None:  # the transfer faults a test asked for (pdserve.faults)
            pd = (replace(pd[0], faults=faults), pd[1])
        if proc.engine_process:
            return _engine_process(cfg, pd, proc.log_level)
        return _engine_thread(cfg, pd)
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


PdConfigs = tuple[ConnectorConfig, TransportConfig] | None


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
