"""The front end's handle on an engine core process (`pdserve serve --engine-process`).

`EngineCoreClient` is an `EngineHandle` (pdserve.engine.handle): the HTTP app uses it as it
uses `AsyncEngine`, but the engine runs in a child process (pdserve.engine.core_process)
with its own interpreter and GIL, so formatting and sending responses never delays a step.

Ownership: the child owns the engine and every KV block; this object owns the child (it
starts it, stops it by PID, and reaps it), the two ZMQ sockets, and the asyncio queues of the
requests it streams. Threads here: a reader that decodes the core's `Step`s and hands each
step's outputs to their requests' event loops (one `call_soon_threadsafe` per loop and
step, as `AsyncEngine` does), and a watcher that notices the child's exit. Sends go out
under a lock (a ZMQ socket is not thread-safe; `abort` may come from any thread).

If the core dies, every open stream ends with an ERROR naming its exit status, `is_alive`
turns False (so /health answers 503), and new requests are refused.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import zmq

from pdserve.config import ConnectorConfig, EngineConfig, TransportConfig
from pdserve.engine.commands import Abort, Add, Release, Stop
from pdserve.engine.core_protocol import Codec, CoreSpec, Ready, Snapshot, StartFailed, Step
from pdserve.engine.handle import EngineDeadError, EngineInfo
from pdserve.engine.sinks import Sinks
from pdserve.engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    LiveRequest,
    RequestOutput,
)
from pdserve.model.tokenizer import Tokenizer
from pdserve.threads import Thread
from pdserve.transfer.params import KVTransferParams, check_pull_params
from pdserve.transfer.release import ReleaseAuth, check_release
from pdserve.transfer.stats import ConnectorMetrics

log = logging.getLogger(__name__)

START_POLL_S = 0.5  # how often start-up checks that the child still lives


class CoreStartError(RuntimeError):
    """The core could not build its engine; `status` is the exit status to pass on (98:
    a port was taken, see pdserve.ports)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class EngineCoreClient:
    """Starts an engine core process and serves as its `EngineHandle` (module doc)."""

    def __init__(
        self,
        engine: EngineConfig,
        connector: ConnectorConfig | None = None,
        transport: TransportConfig | None = None,
        log_level: str = "info",
    ) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-core-"))  # 0700: ours only
        self._spec = CoreSpec(
            engine=engine,
            connector=connector,
            transport=transport,
            to_core=f"ipc://{self._dir}/to-core",
            from_core=f"ipc://{self._dir}/from-core",
            log_level=log_level,
        )
        token = connector.cluster_token if connector else None
        self._token = token  # verifies the router's releases (pdserve.transfer.release)
        pull = connector is not None and connector.mode == "pull"
        self._params_key = token.encode() if token and pull else None
        self._codec = Codec()  # the reader thread's decoders
        self._send_codec = Codec()  # senders' encoder, under `_send_lock`
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._in = self._ctx.socket(zmq.PULL)
        for sock in (self._out, self._in):
            sock.setsockopt(zmq.LINGER, 0)
        self._out.bind(self._spec.to_core)
        self._in.bind(self._spec.from_core)
        self._send_lock = threading.Lock()
        self._sinks = Sinks()
        self._proc: subprocess.Popen[bytes] | None = None
        self._snapshot: Snapshot | None = None
        self._in_use: frozenset[str] = frozenset()
        self._reader = Thread(target=self._read, name="pdserve-core-reader", daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.info: EngineInfo
        self.tokenizer: Tokenizer

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the core and wait until its engine is built (a model load can take
        minutes); raises CoreStartError if it cannot be. Call it from a thread that lives
        as long as the core should: Linux sends the core SIGTERM when the thread that
        started it ends (`PR_SET_PDEATHSIG` follows the thread, not the process)."""
        cmd = [sys.executable, "-m", "pdserve.engine.core_process"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._send_codec.encode(self._spec))
        self._proc.stdin.close()
        log.info("engine core process started (pid %d)", self._proc.pid)
        ready = self._wait_ready()
        self.info = ready.info
        self.tokenizer = Tokenizer.from_dir(ready.info.model_path)
        self._take_snapshot(ready.snapshot)
        self._reader.start()
        Thread(target=self._watch, name="pdserve-core-watch", daemon=True).start()

    def _wait_ready(self) -> Ready:
        assert self._proc is not None
        while not self._in.poll(int(START_POLL_S * 1000)):
            if self._proc.poll() is not None:
                self._cleanup()
                raise CoreStartError(f"engine core exited with {self._proc.returncode}", 1)
        msg = self._codec.from_core.decode(self._in.recv())
        if isinstance(msg, StartFailed):
            self._proc.wait()
            self._cleanup()
            raise CoreStartError(msg.error, msg.status)
        if not isinstance(msg, Ready):
            raise RuntimeError(f"engine core sent {type(msg).__name__} before Ready")
        return msg

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (its requests end with ABORT); SIGKILL it if it does not exit
        within `timeout`. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._send(Stop())
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine core (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._sinks.fail_all("engine shut down", FinishReason.ABORT)
        self._cleanup()

    @property
    def is_alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None and self.error is None

    @property
    def pid(self) -> int | None:
        """The core process's PID (None before `start`)."""
        return self._proc.pid if self._proc is not None else None

    # -- requests --------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request` and yield its outputs until the finished one; closing the
        iterator early aborts the request in the core."""
        return self._sinks.stream(request.request_id, lambda: self._submit(request), self.abort)

    def _submit(self, request: EngineRequest) -> None:
        if not self.is_alive or self._stopped.is_set():
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self._send(Add(request))

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); its stream ends with FinishReason.ABORT."""
        self._send(Abort(request_id))

    def _send(self, msg: msgspec.Struct) -> None:
        with self._send_lock:
            if not self._out.closed:
                self._out.send(self._send_codec.encode(msg))

    # -- reads (from the core's last snapshot) ---------------------------------------------
    def stats(self) -> EngineStats:
        assert self._snapshot is not None
        return self._snapshot.stats

    def live_requests(self) -> list[LiveRequest]:
        assert self._snapshot is not None
        return self._snapshot.live

    def connector_metrics(self) -> ConnectorMetrics | None:
        assert self._snapshot is not None
        return self._snapshot.connector

    def transfer_in_use(self, transfer_id: str) -> bool:
        return transfer_id in self._in_use

    def peer_num_blocks(self, engine_id: str, incarnation: str) -> int | None:
        assert self._snapshot is not None
        peer = self._snapshot.peers.get(engine_id)
        return peer[1] if peer is not None and peer[0] == incarnation else None

    def check_params(self, params: KVTransferParams) -> None:
        check_pull_params(params, self._params_key)

    def check_release(self, transfer_id: str, signature: str | None) -> ReleaseAuth:
        return check_release(self._token, transfer_id, signature)

    def release_transfer(self, transfer_id: str) -> None:
        """Send the router's release to the core (any thread)."""
        self._send(Release(transfer_id))

    def _take_snapshot(self, snap: Snapshot) -> None:
        # Two attribute stores, each atomic: a reader sees the old or the new state.
        self._in_use = frozenset(snap.transfers_in_use)
        self._snapshot = snap

    # -- threads ---------------------------------------------------------------------------
    def _read(self) -> None:
        """Reader thread: the core's steps, in order, to their requests' loops."""
        while not self._stopped.is_set() or self._in.poll(0):
            if not self._in.poll(100):
                if self._proc is not None and self._proc.poll() is not None:
                    return  # the watcher reports it
                continue
            msg = self._codec.from_core.decode(self._in.recv())
            if isinstance(msg, Step):
                if msg.snapshot is not None:
                    self._take_snapshot(msg.snapshot)
                self._sinks.deliver(msg.outputs)

    def _watch(self) -> None:
        """Watcher thread: an exit nobody asked for fails every open stream."""
        assert self._proc is not None
        code = self._proc.wait()
        if self._stopped.is_set():
            return
        self._reader.join(5.0)  # what the core sent before dying still counts
        self.error = EngineDeadError(f"engine core process exited with status {code}")
        log.error("%s", self.error)
        self._sinks.fail_all(f"engine stopped: {self.error!r}", FinishReason.ERROR)

    def _cleanup(self) -> None:
        with self._send_lock:
            self._out.close()
        if not self._reader.is_alive():
            self._in.close()
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
