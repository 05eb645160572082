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

from pdserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pdserve.faults import NO_FAULTS, Faults
from pdserve.httpd.bootstrap import LISTEN_BACKLOG, serve_app
from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket, is_address_in_use
from pdserve.server import vllm_forms
from pdserve.server.exposure import serve_warning
from pdserve.transfer.factory import add_transfer_arguments
from pdserve.vllm import serve as vllm_serve

if TYPE_CHECKING:
    from pdserve.engine.handle import EngineHandle

log = logging.getLogger("pdserve.serve")

API_KEY_ENV = "PDSERVE_API_KEY"
SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long to finish on SIGTERM
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve serve`; each maps onto one field of pdserve.config."""
    mc, cc, sc, vc = ModelConfig(), CacheConfig(), SchedulerConfig(), ServerConfig()
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=mc.model,
        help="'builtin:NAME' or a local Hugging Face model directory (default: %(default)s)",
    )
    model.add_argument(
        "--dtype",
        default=mc.dtype,
        type=vllm_forms.dtype,
        metavar="{auto,float32,bfloat16,float16}",
        help="weight dtype; vLLM's half and float are float16 and float32 (default: %(default)s)",
    )
    model.add_argument("--device", default=mc.device, help="torch device (default: %(default)s)")
    model.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=mc.max_model_len,
        help="max tokens per request, prompt + output (default: the model's context length)",
    )
    model.add_argument(
        "--seed",
        type=int,
        default=mc.seed,
        help="sampling seed for requests without one (default: %(default)s)",
    )
    model.add_argument(
        "--served-model-name",
        default=vc.served_model_name,
        help="model name in the API (default: derived from --model)",
    )
    cache = parser.add_argument_group("KV cache")
    cache.add_argument(
        "--kv-cache-memory",
        type=_positive_float,
        default=cc.kv_cache_memory_gib,
        metavar="GIB",
        help="GiB of memory for the paged KV cache; sets the number of blocks "
        "(default: %(default)s)",
    )
    cache.add_argument(
        "--num-kv-blocks",
        type=_positive_int,
        default=cc.num_blocks,
        help="exact number of KV blocks (overrides --kv-cache-memory)",
    )
    cache.add_argument(
        "--block-size",
        type=_positive_int,
        default=cc.block_size,
        help="tokens per KV block (default: %(default)s)",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=cc.enable_prefix_caching,
        help="reuse the KV of full blocks whose token prefix was computed before "
        "(vLLM's flag; default: on, --no-enable-prefix-caching turns it off)",
    )
    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=sc.max_num_batched_tokens,
        help="token budget of one engine step (prefill chunks + decodes) (default: %(default)s)",
    )
    sched.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=sc.max_num_seqs,
        help="max requests running at once (default: %(default)s)",
    )
    sched.add_argument(
        "--max-prefill-chunk",
        type=_positive_int,
        default=sc.max_prefill_chunk,
        help="max prompt tokens of one request per step (default: the step's token budget)",
    )
    sched.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch intra-op threads (default: torch's choice)",
    )
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine loop in a child process with its own interpreter, so the HTTP "
        "front end (parsing, formatting and sending streams) never holds the GIL the engine "
        "needs; costs one IPC hop per step. Off by default: on 2 cores it did not improve "
        "TPOT (docs/results.md, 'engine loop in its own process')",
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default=vc.host, help="address to listen on (default: %(default)s)")
    http.add_argument(
        "--port",
        type=_port,
        default=vc.port,
        help="port to listen on (0: any free port) (default: %(default)s)",
    )
    http.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, "
        "unset: no key)",
    )
    http.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="log verbosity (default: %(default)s)",
    )
    parser.epilog = (
        "Requests: /v1/completions defaults to max_tokens=16; /v1/chat/completions without "
        "max_tokens may generate up to the rest of the context. Extensions to OpenAI's "
        "parameters: top_k, ignore_eos, stop_token_ids, kv_transfer_params."
    )
    add_transfer_arguments(parser)
    vllm_serve.add_arguments(parser)
    vllm_forms.add_arguments(parser)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (name: value, as vLLM's --config); flags on the command line "
        "override it",
    )


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """After parsing: vLLM's forms folded into pdserve's flags (`parser.error` if bad)."""
    vllm_forms.apply(args, parser)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The frozen configs described by the parsed flags."""
    model = replace(
        ModelConfig(),
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        num_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_prefill_chunk=args.max_prefill_chunk,
    )
    engine = EngineConfig(
        model=model,
        cache=cache,
        scheduler=sched,
        threads=args.threads,
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        # The connector's token (flag or $PDSERVE_CLUSTER_TOKEN): the front end checks legs
        # and routes for routers with it. A monolithic instance has no connector to guard.
        cluster_token=args.cluster_token if args.role != "both" else None,
    )
    return engine, server


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
        engine = _start_engine(args, engine_cfg, faults)
        if isinstance(engine, int):
            return engine
        try:
            if not _listen(sock):
                return EXIT_ADDRESS_IN_USE
            _serve_http(engine, server_cfg, sock, args.log_level)
        finally:
            engine.shutdown()
            log.info("engine stopped")
    return 0


def _start_engine(
    args: argparse.Namespace, cfg: EngineConfig, faults: Faults
) -> EngineHandle | int:
    """The running engine (in a thread, or with `--engine-process` in a child process), or
    the exit status if it cannot be built (logged): 2 for flags that cannot work, 98 for a
    taken side-channel port."""
    # Imported here: torch (in-thread) loads only once the HTTP port is ours.
    from pdserve.engine.core_client import CoreStartError
    from pdserve.transfer.transport import BackendUnavailableError

    try:
        start = _engine_process if args.engine_process else _engine_thread
        return start(args, cfg, faults)
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


def _engine_thread(args: argparse.Namespace, cfg: EngineConfig, faults: Faults) -> EngineHandle:
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.engine import LLMEngine
    from pdserve.transfer.factory import make_connector_factory

    engine = LLMEngine.from_config(cfg, make_connector_factory(args, faults))
    handle = AsyncEngine(engine)
    handle.start()
    return handle


def _engine_process(args: argparse.Namespace, cfg: EngineConfig, faults: Faults) -> EngineHandle:
    from pdserve.engine.core_client import EngineCoreClient
    from pdserve.transfer.factory import connector_config, transport_config

    pd = args.role != "both"
    client = EngineCoreClient(
        cfg,
        replace(connector_config(args), faults=faults) if pd else None,
        transport_config(args) if pd else None,
        log_level=args.log_level,
    )
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {value}")
    return value
